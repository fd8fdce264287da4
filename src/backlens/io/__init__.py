"""Bundles on disk (API.md §6, docs/bundles.md): a capture state, serialized.

* ``bundle``: ``cap.save(path)`` (``save_state``) and ``bl.load(path)`` (``read_bundle``).
* ``disk_store``: ``storage=bl.to_disk(path)``, streaming saved gradients into a
  bundle while the backward runs.
* ``manifest``, ``schema``, ``shards``, ``names``: the manifest's layout and
  checks, the state's entries under format version 2, safetensors shards, and
  the bundle's file names. No pickle anywhere.
"""
