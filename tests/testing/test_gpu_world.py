"""Several ranks on one GPU, the parts a CPU can check: rank placement and each rank's environment, the
MPS daemon's commands (a fake ``nvidia-cuda-mps-control`` on PATH), the world's process machinery (spawned ranks on
CPU devices: tasks, environment forwarding, failures, timeouts, cleanup), the barrier every group backend supports,
and the per-process program cap (TRITONEP_MAX_PROGRAMS) of ranks that share a GPU under MPS."""

import json
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tritonep.errors import ConfigError, RankError
from tritonep.testing import GpuWorld, WorldTimeout, gpu_world_info, run_cpu_world
from tritonep.testing.mps import MpsDaemon, MpsUnavailable
from tritonep.testing.placement import (MAX_RANKS_PER_DEVICE, place_ranks, plan_world, programs_per_rank,
                                        rank_environment)


# ------------------------------------------------------------------------------------------------ placement
def test_ranks_go_round_robin_and_share_only_when_they_must():
    assert place_ranks(4, 1) == [0, 0, 0, 0]
    assert place_ranks(3, 2) == [0, 1, 0]
    assert place_ranks(2, 8) == [0, 1]
    one = plan_world(2, ["cuda:0", "cuda:1"], mps=True)  # a GPU per rank: NCCL, no MPS whatever was asked
    assert (one.mode, one.backend, one.shared, one.devices) == ("exclusive", "nccl", False, ("cuda:0", "cuda:1"))
    assert one.timing_note() == "" and rank_environment(one) == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    ts = plan_world(3, ["cuda:0", "cuda:1"], mps=False)
    assert (ts.mode, ts.backend, ts.ranks_per_device, ts.num_devices) == ("time-sliced", "gloo", 2, 2)
    assert ts.devices == ("cuda:0", "cuda:1", "cuda:0")
    env = rank_environment(ts)
    assert env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1" and "CUDA_MPS_PIPE_DIRECTORY" not in env
    assert "NVLink" in ts.timing_note() and "time-sliced" in ts.describe()
    mps = plan_world(4, ["cuda:0"], mps=True)
    assert (mps.mode, mps.active_thread_percentage) == ("mps", 25)
    env = rank_environment(mps, {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l"})
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and env["CUDA_MPS_PIPE_DIRECTORY"] == "/p"
    assert json.loads(json.dumps(mps.as_dict()))["shared"] is True


def test_program_share_of_the_chip_fits_every_rank_at_once():
    for n, want in ((1, 132), (2, 66), (3, 42), (4, 32), (8, 14)):
        got = programs_per_rank(132, n)
        assert got == want and got * n <= 132, (n, got)


def test_an_mps_daemon_already_running_caps_the_ranks_too(tmp_path, monkeypatch):
    """Ranks join an MPS daemon of the machine without being asked (CUDA_MPS_PIPE_DIRECTORY, or the default
    /tmp/nvidia-mps): they then run at once and get the MPS shares and program cap, and no daemon of our own."""
    from tritonep.testing.mps import external_mps_pipe

    (tmp_path / "control").write_text("")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert external_mps_pipe() == str(tmp_path)
    w = GpuWorld(2, devices=["cpu"])
    assert w.info.mode == "mps" and w.info.active_thread_percentage == 50 and str(tmp_path) in w.info.note
    assert w._start_mps() == {}  # the machine's daemon, not one of ours
    assert external_mps_pipe({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}) is None


def test_refusals_name_the_values():
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        plan_world(2, [], mps=False)
    with pytest.raises(ConfigError, match=f"9 ranks on one device; at most {MAX_RANKS_PER_DEVICE}"):
        plan_world(9, ["cuda:0"], mps=False)
    with pytest.raises(ConfigError, match="mps='yes'"):
        GpuWorld(2, mps="yes", devices=["cpu"])


# ------------------------------------------------------------------------------------------------ MPS daemon
_FAKE = '''#!{python}
import json, os, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
stdin = "" if sys.argv[1:] == ["-d"] else sys.stdin.read()
with open(os.environ["FAKE_MPS_LOG"], "a") as f:
    f.write(json.dumps(dict(argv=sys.argv[1:], stdin=stdin, pipe=pipe,
                            log=os.environ.get("CUDA_MPS_LOG_DIRECTORY"))) + "\\n")
marker = os.path.join(pipe, "control")
if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAKE_MPS_MODE") == "fail":
        sys.exit("An instance of this daemon is already running")
    open(marker, "w").close()
    sys.exit(0)
if not os.path.exists(marker):
    sys.exit("Cannot find MPS control daemon process")
if stdin.strip() == "quit":
    os.remove(marker)
'''


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """A fake nvidia-cuda-mps-control on PATH that logs every call (argv, stdin, the MPS directories) as JSON."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(_FAKE.format(python=sys.executable))
    exe.chmod(0o755)
    log = tmp_path / "mps_calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_mps_daemon_commands_and_private_directories(fake_mps, tmp_path):
    d = MpsDaemon(str(tmp_path / "world"))
    assert d.start_command()[1:] == ["-d"] and d.start_command()[0].endswith("nvidia-cuda-mps-control")
    assert d.env() == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "world" / "mps_pipe"),
                       "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "world" / "mps_log")}
    d.start()
    assert d.stop() is True
    calls = fake_mps()
    assert calls[0]["argv"] == ["-d"] and calls[0]["pipe"] == d.pipe_dir and calls[0]["log"] == d.log_dir
    assert any(c["stdin"] == "get_server_list\n" for c in calls[1:])  # start waits until the daemon answers
    assert [c["stdin"] for c in calls if c["stdin"] == "quit\n"] == ["quit\n"]
    assert all(c["pipe"] == d.pipe_dir for c in calls)


def test_mps_that_cannot_start_is_one_line(fake_mps, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_MODE", "fail")
    with pytest.raises(MpsUnavailable) as ei:
        MpsDaemon(str(tmp_path / "w")).start()
    assert "\n" not in str(ei.value) and "exited 1" in str(ei.value) and "already running" in str(ei.value)
    with monkeypatch.context() as m:
        m.setenv("PATH", str(tmp_path / "no_bin"))
        with pytest.raises(MpsUnavailable, match="nvidia-cuda-mps-control is not on PATH"):
            MpsDaemon(str(tmp_path / "w2")).start()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(MpsUnavailable):  # mps=True: refused before any rank starts; nothing left behind
        GpuWorld(2, mps=True, devices=["cpu"]).start(timeout_s=60)
    assert not list(tmp_path.glob("tritonep_world_*"))


# ------------------------------------------------------------------------------------------------ the world's processes
def _env_world(group):
    info = gpu_world_info()
    keys = ("TRITONEP_GEOMETRY", "TRITONEP_MAX_PROGRAMS", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "NCCL_NVLS_ENABLE")
    os.environ["TRITONEP_COMBINE"] = "pull"  # a task's own changes must not reach the next task
    return dist.get_rank(group), os.getpid(), info.mode, dist.get_backend(group), {k: os.environ.get(k) for k in keys}


def _combine_seen(group):
    return os.environ.get("TRITONEP_COMBINE")


def _fail_on_rank1(group):
    if dist.get_rank(group) == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier(group)  # rank 0 waits for rank 1, which never comes: the world must still end at once
    return "ok"


def _sleep(group, seconds):
    time.sleep(seconds)
    return "slept"


def _alive(pids):
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_world_runs_tasks_with_the_callers_environment_and_cleans_up(tmp_path, monkeypatch, fake_mps):
    """One world of 2 ranks sharing one (CPU) device under a (fake) MPS daemon: several tasks in the same processes,
    the parent's TRITONEP_* at each call, the world's own variables, a failing rank, then everything gone."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    world = GpuWorld(2, mps=True, devices=["cpu"]).start(timeout_s=240)
    try:
        assert world.info.mode == "mps" and world.info.backend == "gloo" and world.info.shared
        root = next(tmp_path.glob("tritonep_world_*"))
        monkeypatch.setenv("TRITONEP_GEOMETRY", "bt=2")
        first = world.run(_env_world, timeout_s=120)
        monkeypatch.delenv("TRITONEP_GEOMETRY")
        monkeypatch.setenv("TRITONEP_MAX_PROGRAMS", "7")
        second = world.run(_env_world, timeout_s=120)
        assert world.run(_combine_seen, timeout_s=120) == [None, None]
        assert first.info is world.info
        pids = [r[1] for r in first]
        assert [r[0] for r in first] == [0, 1] and [r[1] for r in second] == pids  # the same processes
        for r in first:
            assert r[2:4] == ("mps", "gloo")
            env = r[4]
            assert env["TRITONEP_GEOMETRY"] == "bt=2" and env["NCCL_NVLS_ENABLE"] == "0"
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root / "mps_pipe")
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            assert env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1"
        assert all(r[4]["TRITONEP_GEOMETRY"] is None and r[4]["TRITONEP_MAX_PROGRAMS"] == "7" for r in second)
        t0 = time.monotonic()
        with pytest.raises(RankError, match="rank 1 raised ValueError: rank 1 fails on purpose") as ei:
            world.run(_fail_on_rank1, timeout_s=120)
        assert ei.value.rank == 1 and time.monotonic() - t0 < 30
        assert world.broken and not world.alive
        with pytest.raises(ConfigError, match="unusable"):
            world.run(_combine_seen)
    finally:
        world.close()
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids), "a rank outlived its world"
    assert not list(tmp_path.glob("tritonep_world_*")), "the world's temporary folder is left"
    assert [c["stdin"] for c in fake_mps() if c["stdin"] == "quit\n"] == ["quit\n"]  # the daemon was stopped


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_world_past_its_time_is_killed_and_auto_mps_falls_back(tmp_path, monkeypatch, fake_mps, capfd):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("FAKE_MPS_MODE", "fail")
    world = GpuWorld(2, mps="auto", devices=["cpu"]).start(timeout_s=240)
    try:
        err = capfd.readouterr().err
        lines = [ln for ln in err.splitlines() if "MPS" in ln]
        assert len(lines) == 1 and "time-slice instead" in lines[0], err
        assert world.info.mode == "time-sliced" and "exited 1" in world.info.note
        for r in world.run(_env_world, timeout_s=120):  # no MPS variable reached the ranks
            assert r[2] == "time-sliced" and r[4]["CUDA_MPS_PIPE_DIRECTORY"] is None
            assert r[4]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] is None
        t0 = time.monotonic()
        with pytest.raises(WorldTimeout) as ei:
            world.run(_sleep, 120, timeout_s=3)
        assert ei.value.ranks == [0, 1] and time.monotonic() - t0 < 20
        assert not world.alive
    finally:
        world.close()
    assert not list(tmp_path.glob("tritonep_world_*"))


# ------------------------------------------------------------------------------------------------ barrier helper
def _barrier_world(group):
    from tritonep.memory import group_barrier, uses_nccl

    group_barrier(group)
    group_barrier(group, "cpu")
    return uses_nccl(group), dist.get_rank(group)


def test_group_barrier_on_gloo_is_a_plain_barrier_every_rank_records():
    assert run_cpu_world(3, _barrier_world, timeout_s=120) == [(False, 0), (False, 1), (False, 2)]


def test_group_barrier_picks_the_backend_s_barrier(monkeypatch):
    """NCCL group: ``barrier(device_ids=[i])``; any other group on a CUDA device: synchronise it, then a host barrier
    (gloo has no device_ids); CPU or no device: a host barrier."""
    from tritonep.memory import collectives

    calls = []
    monkeypatch.setattr(collectives.dist, "barrier", lambda **kw: calls.append(("barrier", kw)))
    monkeypatch.setattr(collectives.torch.cuda, "synchronize", lambda i: calls.append(("sync", i)))
    for backend in ("nccl", "gloo", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(collectives.dist, "get_backend", lambda g, b=backend: b)
        calls.clear()
        collectives.group_barrier("G", "cuda:1")
        collectives.group_barrier("G", 2)
        collectives.group_barrier("G", "cpu")
        collectives.group_barrier("G")
        if "nccl" in backend:
            assert calls[:2] == [("barrier", dict(group="G", device_ids=[1])), ("barrier", dict(group="G", device_ids=[2]))]
        else:
            assert calls[:4] == [("sync", 1), ("barrier", dict(group="G")), ("sync", 2), ("barrier", dict(group="G"))]
        assert calls[-2:] == [("barrier", dict(group="G")), ("barrier", dict(group="G"))]


# ------------------------------------------------------------------------------------------------ program cap
def test_max_programs_clips_every_waiting_grid_and_keeps_the_table_s_choices(monkeypatch):
    from tests.support.tiles import tiles_of
    from tritonep.backends.triton.kernels.layout import exchange_tiles

    monkeypatch.delenv("TRITONEP_GEOMETRY", raising=False)
    free = tiles_of("cuda", 2, 7168, 4096, 8)
    assert free.fused_send + free.fused_expand > 32 and free.grid_partial > 32
    monkeypatch.setenv("TRITONEP_MAX_PROGRAMS", "32")
    g = tiles_of("cuda", 2, 7168, 4096, 8)
    assert g.fused_send > 0 and g.fused_send + g.fused_expand <= 32  # still the fused dispatch, within the cap
    assert (g.bt, g.num_warps, g.cbt, g.cwarps) == (free.bt, free.num_warps, free.cbt, free.cwarps)
    assert max(g.grid_hist, g.grid_send, g.grid_expand, g.grid_partial, g.grid_out) <= 32
    assert tiles_of("cuda", 2, 7168, 4096, 8, num_sms=16).grid_partial == 16  # the smaller cap wins
    monkeypatch.setenv("TRITONEP_GEOMETRY", "bt=1,dec=128")
    assert tiles_of("cuda", 2, 7168, 128, 8).decode == 32
    monkeypatch.delenv("TRITONEP_GEOMETRY")
    assert exchange_tiles(256, 1024)[0] == 32 and exchange_tiles(256, 1024, 3)[0] == 3  # the config's cap
    assert tiles_of("cuda", 2, 7168, 4096, 8, max_programs=8).grid_partial == 8  # the argument wins
    monkeypatch.setenv("TRITONEP_MAX_PROGRAMS", "-1")
    with pytest.raises(ConfigError, match="TRITONEP_MAX_PROGRAMS"):
        tiles_of("cuda", 2, 7168, 4096, 8)


def test_launch_refuses_a_grid_above_the_cap():
    from tritonep.backends.triton.kernels.layout import chunk_hist_kernel
    from tritonep.runtime.launch import Launch

    launch = Launch(torch.device("cpu"), max_programs=2)  # a buffer's config.max_programs (TRITONEP_MAX_PROGRAMS)
    with pytest.raises(ConfigError, match=r"chunk_hist_kernel: grid \(3,\) exceeds TRITONEP_MAX_PROGRAMS=2"):
        launch.bind(chunk_hist_kernel, dict(hist_ptr=None, K=2, E=4, EB=4, BT=16, KB=2), ("topk_idx_ptr", "T", "NC"),
                    grid=(3,))


def test_exchange_and_ep_calls_exact_with_one_program_per_waiting_kernel(monkeypatch):
    """TRITONEP_MAX_PROGRAMS=1: the counts exchange of 64 experts (two expert blocks) runs in one program that loops
    over both; dispatch + combine equal the reference."""
    from tests.support.harness import calls_world, check_calls, make_calls

    monkeypatch.setenv("TRITONEP_MAX_PROGRAMS", "1")
    cfg = dict(E=64, H=64, Tmax=8, K=4, fn=_identity, out_buffer=False)
    calls = make_calls(2, cfg, [8, 5], seeds=[1, 2])
    check_calls(cfg, calls, run_cpu_world(2, calls_world, cfg, calls, timeout_s=300))


def _identity(x):
    return x
