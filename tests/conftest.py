"""Pytest setup: CPU runs use the Triton interpreter; GPU tests carry the ``gpu`` marker and skip without CUDA.

Multi-rank GPU tests take the ``gpu_world`` fixture, the ONE gate and runner of GPU worlds: ``gpu_world(W, fn, *args,
timeout_s=..., nccl=False)`` runs ``fn(group, *args)`` on ``W`` ranks placed on the GPUs present (ranks share a GPU
when there are fewer GPUs than ranks: gloo group, time-sliced, or under MPS with ``--gpu-mps on``), in a world that
stays up for the following tests of the same size (start-up is paid once per world, not per test). Only what needs
one GPU per rank skips, saying why: ``nccl=True`` (an NCCL group: NCCL refuses two ranks on one GPU).
Tests that run at any world size take ``gpu_world_size`` (``--gpu-world-sizes 2,4``; default 2).
Markers added at collection: ``world`` (uses ``gpu_world``), ``anyworld`` (uses ``gpu_world_size``); set by hand:
``world1`` (a world of one rank); the GPU runner selects with them (scripts/gpu.sh).
"""

import os

import pytest

try:  # decide before any tritonep kernel module is imported (triton reads the flag at decoration time)
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # single-process kernel tests: the interpreter's faster patches
    from tritonep.runtime.interpreter_speed import install as _install_interpreter_speed

    _install_interpreter_speed()


def pytest_addoption(parser):
    g = parser.getgroup("tritonep GPU worlds")
    g.addoption("--gpu-world-sizes", default="2",
                help="world sizes of the GPU tests that take any (comma-separated, e.g. 2,3,4; default 2); ranks share "
                     "GPUs when there are fewer GPUs than ranks")
    g.addoption("--gpu-mps", choices=["off", "on", "auto"], default="off",
                help="ranks that share a GPU: off = time-sliced (default); on = one private MPS daemon per world "
                     "(an error if it cannot start); auto = MPS if it starts")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (run on the device machine)")
    config.addinivalue_line("markers", "soak: long soak tests: not in the default run; CI's second step runs them")
    config.addinivalue_line("markers", "compile: compiles recorded launches for sm_90 offline (minutes on a cold Triton "
                                       "cache): not in the default run; CI's second step runs them")
    config.addinivalue_line("markers", "world: runs ranks on GPUs through the gpu_world fixture")
    config.addinivalue_line("markers", "anyworld: a GPU world test that runs at every --gpu-world-sizes")
    config.addinivalue_line("markers", "world1: a GPU world of one rank (gpu_world(1, ...)); scripts/gpu.sh runs "
                                       "it with the one-process GPU tests, not in its shared-GPU worlds")


def pytest_generate_tests(metafunc):
    if "gpu_world_size" in metafunc.fixturenames:
        sizes = [int(w) for w in str(metafunc.config.getoption("--gpu-world-sizes")).split(",") if w.strip()]
        metafunc.parametrize("gpu_world_size", sizes, ids=[f"W{w}" for w in sizes])


_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def _slow_ids() -> set:
    """Node ids listed in tests/slow_tests.txt (``seconds node-id`` lines, ``#`` comments): the tests measured
    slowest on a 2-core CPU host (scripts/slow_tests.py writes the list from a ``--durations`` log). They get the
    ``slow`` marker: the default run deselects them (pyproject addopts) and CI's second step runs them."""
    ids = set()
    with open(_SLOW_LIST) as f:
        for line in f:
            line = line.split("#", 1)[0].split()
            if line:
                ids.add(line[-1])
    return ids


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the markers below take part in the selection
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    slow = _slow_ids()
    seen = set()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
            seen.add(item.nodeid)
        names = getattr(item, "fixturenames", ())
        if "gpu_world" in names:
            item.add_marker(pytest.mark.world)
        if "gpu_world_size" in names:
            item.add_marker(pytest.mark.anyworld)
        if item.get_closest_marker("gpu") is not None and not _HAS_CUDA:  # the marker, not a test id that says gpu
            item.add_marker(skip_gpu)
    # a listed id that names no test of a module collected here: renamed or removed; the list must follow it
    files = {item.nodeid.split("::", 1)[0] for item in items}
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS or not config.args
    stale = sorted(i for i in slow - seen if whole and i.split("::", 1)[0] in files)
    if stale:
        raise pytest.UsageError(f"tests/slow_tests.txt lists test ids that do not exist: {stale}; rename or remove "
                                f"them (scripts/slow_tests.py)")


class _GpuWorlds:
    """The session's GPU worlds: one live :class:`tritonep.testing.GpuWorld` at a time, reused by every test of the
    same world size; a world that failed (a rank raised, a timeout) is gone and the next test starts a new one."""

    def __init__(self, mps):
        self.mps = mps
        self.world = None

    def __call__(self, world_size, fn, *args, timeout_s=300.0, nccl=False):
        from tritonep.testing import GpuWorld
        from tritonep.testing.placement import plan_world

        if not _HAS_CUDA:
            pytest.skip("needs a CUDA GPU")
        ngpu = torch.cuda.device_count()
        plan = plan_world(world_size, [f"cuda:{i}" for i in range(ngpu)], mps=bool(self.mps))
        if nccl and plan.shared:
            pytest.skip(f"needs {world_size} GPUs, one per rank: an NCCL group, and NCCL refuses two ranks on one GPU "
                        f"({ngpu} GPU(s) here; the nccl backend's logic runs over gloo in the CPU world tests)")
        w = self.world
        if w is None or not w.alive or w.world_size != world_size:
            self.close()
            w = self.world = GpuWorld(world_size, mps=self.mps).start(timeout_s=300)
        return w.run(fn, *args, timeout_s=timeout_s)

    def close(self):
        if self.world is not None:
            self.world.close()
            self.world = None


@pytest.fixture(scope="session")
def _gpu_worlds(request):
    worlds = _GpuWorlds({"off": False, "on": True, "auto": "auto"}[request.config.getoption("--gpu-mps")])
    yield worlds
    worlds.close()


@pytest.fixture
def gpu_world(_gpu_worlds):
    """``gpu_world(W, fn, *args, timeout_s=300, nccl=False)`` -> every rank's result (``.info``: how it ran)."""
    return _gpu_worlds
