"""Bundles on disk (API.md §6, docs/bundles.md): a capture state, serialized.

* ``bundle``: ``cap.save(path)`` (``save_state``) and ``bl.load(path)`` (``read_bundle``).
* ``disk_store``: ``storage=bl.to_disk(path)``, streaming saved gradients into a
  bundle while the backward runs.
* ``manifest``, ``schema``, ``shards``, ``names``: the manifest's layout and
  checks, the state's entries under format version 2, safetensors shards, and
  the bundle's file names. No pickle anywhere.
* ``files``: reading a bundle directory as untrusted input (no link followed,
  nothing outside it opened, sizes and JSON depth bounded).
* ``replace``: putting a finished bundle in place atomically, recovering an
  interrupted replacement, removing what interrupted saves left.
* ``markers``: telling a bundle, an unfinished stream and a save's leftovers
  from what backlens did not write (nothing else is ever replaced or removed).
* ``locks``: the lock a streaming capture holds on its directory.
* ``consistency``: a loaded state's records checked against each other and
  against their tensors.
"""
