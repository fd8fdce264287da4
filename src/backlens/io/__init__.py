"""Bundles on disk (API.md §6, docs/bundles.md).

* ``bundle.save`` / ``bundle.load``: ``cap.save(path)`` and ``bl.load(path)``.
* ``disk_store.to_disk``: ``storage=bl.to_disk(path)``, streaming saved
  gradients into a bundle while the backward runs.
* ``loaded.LoadedCapture``: a bundle read back as the same records.
* ``manifest``, ``codec``, ``shards``: the manifest layout, record values as
  JSON, and safetensors shards. No pickle anywhere.
"""
