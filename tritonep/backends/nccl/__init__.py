"""The nccl backend: ``torch.distributed`` collectives, for any group (several hosts included).

:mod:`.backend` (:class:`NcclEP`: one class composed of parts; the synced dispatch), :mod:`.combine`
(:class:`NcclCombine`: combine and both backwards), :mod:`.sync_free` (:class:`SyncFreeDispatch`:
``dispatch(sync_free=True)``, no host read) and :mod:`.onehop` (its one-hop mode), :mod:`.route` / :mod:`.unpack`
(counts row, packing, expert rows, backward row moves), :mod:`.pack` (the combine's fixed-order sums), :mod:`.plan`
(the host plan: layout and all_to_all split sizes; the device plan's twin), :mod:`.handle` (:class:`NcclHandle`),
:mod:`.kernels` (their @triton.jit bodies), and the virtual-expert services: :mod:`.counts` (counts exchange) and
:mod:`.expert_transport` (all_to_all per weight), over :mod:`.collectives`. EPBuffer reaches it only through the
registry and the backend interface (:mod:`tritonep.backends`).
"""
