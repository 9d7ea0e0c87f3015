"""Adapters that put tritonep under training frameworks (top of the import order: they import tritonep, never the
other way round). Each adapter is its own module and imports its framework only when it is imported itself:

* :mod:`tritonep.integrations.torchtitan`: a torchtitan (``torchtitan==0.3.0``; in a clone ``pip install -e
  '.[torchtitan]'``, tritonep is not a published package) token dispatcher over :class:`tritonep.EPBuffer`, selectable with torchtitan's ``--override.imports``.
"""

__all__: list[str] = []
