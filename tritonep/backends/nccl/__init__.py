"""The nccl backend: ``torch.distributed`` collectives, for any group (several hosts included).

:mod:`.backend` (:class:`NcclEP`), :mod:`.plan` (the host plan: layout and all_to_all split sizes; the sync-free
dispatch's device-plan twin), :mod:`.sync_free` (``dispatch(sync_free=True)``: no host read), :mod:`.pack`
(local row gathers and the combine's fixed-order sums, host wrappers of :mod:`tritonep.backends.nccl.kernels.reduce`),
:mod:`.combine`, and the virtual-expert data movement services: :mod:`.counts` (counts exchange) and
:mod:`.expert_transport` (all_to_all per weight), over :mod:`.collectives`. EPBuffer reaches it only through the
registry (:mod:`tritonep.backends`).
"""
