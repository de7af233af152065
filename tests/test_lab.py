"""The hardware backends on a real Linux CXL stack, in QEMU guests (the virtual CXL lab).

Each test boots TCG guests with a CXL Type-3 device (emulation/lab/) and runs this
suite inside them: on /dev/dax0.0, on the CPU-less NUMA node the device becomes,
and across two guests that share one device (two hosts, one CXL memory). CXL
memory in QEMU is emulated MMIO (a few MB/s), so the guest runs leave out the two
throughput-bound tests (the allocator stress and the 1.5 s starvation run), which
run on every other backend. The failure-injection suites (crash points, stalls past
the lease, many rounds of kills) leave the guests too: they test protocols, not the
medium, run on five backends outside, and would take the guests past their time.
They skip, saying why, only where the lab is not set up; .ci/run sets it up.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import pytest

from .labqueue import Job

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAB = pathlib.Path(os.environ.get("CXLRT_LAB", pathlib.Path.home() / ".cache" / "cxlrt-lab"))
SCRIPTS = ROOT / "emulation" / "lab"
READY = (LAB / "initramfs.cpio.gz").exists() and bool(shutil.which("qemu-system-x86_64"))

pytestmark = [
    pytest.mark.lab,
    pytest.mark.skipif(not READY, reason="the virtual CXL lab is not set up on this machine: "
        "run `bash emulation/lab/setup.sh` (QEMU >= 8 from Debian backports, a 6.12 kernel)"),
]

# Each test's guest run, by test name: tests/conftest.py hands those of the session's lab
# tests to tests/labqueue.py when collection ends, and each test waits for its own.
JOBS: dict[str, Job] = {}


def _mounts():
    # The checkout and the Python install at the same paths in the guest, so the
    # editable install and its compiled modules resolve there as they do here.
    out = []
    for p in {str(ROOT), sys.base_prefix, sys.prefix}:
        out += ["--mount", f"{p}:{p}"]
    return out


# The failure-injection suites (see the module docstring).
GUEST_SKIP = (
    # The magazines' suite is node-local protocol (threads, forks, pid namespaces, kills)
    # over the same medium calls as the allocator's: outside, on every backend.
    "--ignore=tests/algorithms/test_alloc_magazine.py "
    "--ignore=tests/algorithms/test_recovery.py --ignore=tests/algorithms/test_clock_skew.py "
    "--ignore=tests/algorithms/test_directory_crash.py "
    "--ignore=tests/algorithms/test_kvcache_failures.py "
    "--ignore=tests/algorithms/test_channel_roles.py "
    "-k 'not starve and not stress and not replayed and not beyond_any_queue "
    "and not slow_allocator_lock and not mid_free and not busy_owner and not mid_step "
    "and not torch_tensor and not cuda_tensor and not leaves_behind'")
# The torch tensor targets test the copy into a torch buffer, not the medium; importing
# torch over 9p in a TCG guest costs minutes, so they run on the five backends outside.
# `leaves_behind` starts a fresh interpreter per case (a process that exits holding a
# lock): a failure-injection test like those above, run outside on every backend.


def _guest_pytest(env, args):
    return (f"cd {ROOT} && export PYTHONDONTWRITEBYTECODE=1 {env} && "
            f"{sys.executable} -m pytest -q -p no:cacheprovider {args}")


def _job(name, cmd, timeout=900, **env):
    # run.sh stops its guests after $LAB_TIMEOUT, 300 s unless told: give them the bound
    # the run is given, less a margin for QEMU's start and exit. At 300 s a guest's suite
    # was cut off on a host whose cores are slower than those it was timed on.
    env = dict(os.environ, **env)
    env.setdefault("LAB_TIMEOUT", str(timeout - 30))
    JOBS[name] = Job(cmd, timeout, env)


def _run(request):
    """The output of this test's guest run, once it has ended well."""
    rc, out = JOBS[request.node.name].result()
    tail = "\n".join(out.splitlines()[-40:])
    assert rc == 0, f"lab run failed (exit {rc}):\n{tail}"
    return out


_job("test_backend_suite_on_devdax_in_a_guest",
     ["bash", str(SCRIPTS / "run.sh"), "--cxl", "devdax", *_mounts(), "--",
      _guest_pytest("CXLRT_TEST_DAX=/dev/dax0.0",
                    f"tests/test_dax.py tests/algorithms/ {GUEST_SKIP} --backend devdax")])
_job("test_backend_suite_on_a_cpu_less_numa_node_in_a_guest",
     ["bash", str(SCRIPTS / "run.sh"), "--cxl", "numa", *_mounts(), "--",
      "numactl -H | grep -q '^node 1 cpus: *$' && " + _guest_pytest(
          "CXLRT_TEST_NUMA_NODE=1", f"tests/test_numa.py tests/algorithms/ {GUEST_SKIP} "
          "--backend numa")])
_node = [f"cd {ROOT} && PYTHONDONTWRITEBYTECODE=1 {sys.executable} "
         f"tests/lab/pair_node.py {n} 300" for n in (0, 1)]
_job("test_two_guests_share_one_cxl_device",
     ["bash", str(SCRIPTS / "pair.sh"), *_mounts(), "--", _node[0], "--", _node[1]])


@pytest.mark.slow
@pytest.mark.timeout(960)  # a TCG guest: its own bound (the run inside: 900 s), not 300 s
def test_backend_suite_on_devdax_in_a_guest(request):
    out = _run(request)
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
@pytest.mark.timeout(960)  # a TCG guest: its own bound (the run inside: 900 s), not 300 s
def test_backend_suite_on_a_cpu_less_numa_node_in_a_guest(request):
    out = _run(request)
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
@pytest.mark.timeout(960)  # two TCG guests: their own bound (the run inside: 900 s)
def test_two_guests_share_one_cxl_device(request):
    out = _run(request)
    for n in (0, 1):
        assert f"node {n}: counter 600 (expected 600)" in out
        assert "other node's 8 blocks verified" in out


# --- rdma: a region served over SoftRoCE (rxe on the guest's lo) -----------------
# Two vCPUs: rxe does its work in kernel threads, and with one vCPU every request
# waits for the guest's scheduler (an 8-byte READ: 8 ms, against 0.5 ms on two).

def _rdma_job(name, cxl, cmd, timeout=900):
    serve = f"sh {SCRIPTS}/rdma-serve.sh {sys.executable}"
    _job(name, ["bash", str(SCRIPTS / "run.sh"), "--cxl", cxl, *_mounts(), "--",
                f"cd {ROOT} && export PYTHONDONTWRITEBYTECODE=1 && " + cmd(serve)],
         timeout + 60, LAB_SMP="2", LAB_TIMEOUT=str(timeout))


def _have_rdma_module():
    from cxlrt import registry
    try:
        registry.get("rdma")
    except ImportError as e:  # the lab is set up (it installs libibverbs-dev): rebuild
        pytest.fail(f"{e}: the lab is set up here, so `pip install -e .` again builds it")


# Over rdma: every access is a round trip through rxe in a TCG guest (about 0.2 ms), so
# the four longest tests (2 to 3 minutes each there: 65535 pins, 4 nodes x 2 processes
# contending, a trim of the whole heap, a cache turned over to exhaustion) stay with the
# five backends outside, which run them in seconds. They test the algorithms' counts and
# contention, not the medium.
RDMA_GUEST_SKIP = GUEST_SKIP[:-1] + (
    " and not 65535 and not mutual_exclusion_4_nodes and not close_during_a_heap_section"
    " and not out_of_memory_evicts'")
SERVED = [("devdax", "dax:/dev/dax0.0"), ("numa", "numa:1/served")]

_rdma_job("test_backend_suite_over_rdma_in_a_guest", "none", lambda serve: (
    f"S=$({serve} file:/tmp/r0 r0 7470 64M) && export CXLRT_TEST_RDMA=$S && "
    + _guest_pytest("", f"tests/algorithms/ {RDMA_GUEST_SKIP} --backend rdma")))
for _cxl, _served in SERVED:
    _rdma_job(f"test_rdma_server_on_cxl_memory_in_a_guest[{_cxl}]", _cxl,
              lambda serve, _served=_served: (
                  f"S=$({serve} {_served} cxl 7471 64M) && {sys.executable} "
                  "tests/lab/rdma_clients.py $S 3 10 && cat /tmp/cxlrt-serve-cxl.log"))
_rdma_job("test_rdma_failures_in_a_guest", "none", lambda serve: (
    f"sh {SCRIPTS}/rxe-up.sh lo && {sys.executable} tests/lab/rdma_failures.py"))


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_backend_suite_over_rdma_in_a_guest(request):
    """The algorithm suite over rdma:, its multi-process tests being 3+ client
    processes of one server."""
    _have_rdma_module()
    out = _run(request)
    assert " passed" in out and "failed" not in out


@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("cxl,served", SERVED, ids=[c for c, _ in SERVED])
def test_rdma_server_on_cxl_memory_in_a_guest(request, cxl, served):
    """`cxlrt serve` on the guest's CXL device (devdax) and on its CPU-less NUMA node,
    with 3 client processes."""
    _have_rdma_module()
    out = _run(request)
    assert "rdma clients: 3 passed" in out
    assert f"-> {served}" in out


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_rdma_failures_in_a_guest(request):
    """Refused connection, unknown region, wrong geometry, a corrupted key, the server
    killed and restarted (the cut-off client's hold is broken, `cxlrt check` is clean),
    the server stopped: each a clear error within the bound. Reconnects: a stale key
    renewed, a failed write never repeated, an outage inside the lease resumed, one
    past it fenced like a stall, another region under the name refused, the window
    running out, a queue pair that stops completing (the deadline), a READ failing on
    every new attachment, close() racing a swap, a claim during an outage, and a server
    host that restarted."""
    _have_rdma_module()
    out = _run(request)
    assert "rdma failures: all passed" in out
    for case in ("connection refused", "unknown region", "node held by another host",
                 "node outside the count refused by the server",
                 "registered and unregistered buffers",
                 "corrupted key", "server killed",
                 "hold of a cut-off client broken", "cxlrt check after the restart",
                 "corrupted key renewed by a reconnect", "failed write never repeated",
                 "outage inside the lease resumed", "outage past the lease fenced like a stall",
                 "cxlrt check after the reconnects", "another region under the name refused",
                 "server not back within the window", "no completion: the deadline",
                 "no completion: a new queue pair",
                 "a beat whose completion was lost written again",
                 "a READ failing on every attachment", "close() racing a swap",
                 "a claim during an outage goes through the next attachment",
                 "a server host that restarted refused", "server stopped"):
        assert f"PASS {case}" in out, case


_RDMA_A = (f"cd {ROOT} && RDMA_NETDEV=eth0 RDMA_IP=10.9.0.1/24 RDMA_ADDR=10.9.0.1 "
           f"sh {SCRIPTS}/rdma-serve.sh {sys.executable} file:/tmp/r0 r0 7470 16M && i=0; "
           "until [ -e /mnt/flag/done ] || [ $i -gt 1200 ]; do sleep 0.5; i=$((i+1)); done; "
           "cat /tmp/cxlrt-serve-r0.log")
_RDMA_B = (f"cd {ROOT} && RDMA_IP=10.9.0.2/24 sh {SCRIPTS}/rxe-up.sh eth0 && "
           f"PYTHONDONTWRITEBYTECODE=1 {sys.executable} tests/lab/rdma_clients.py "
           "rdma:10.9.0.1:7470/r0 3 10; rc=$?; touch /mnt/flag/done; exit $rc")
# B tells A it is done through a folder both guests mount: the run's scratch folder.
_job("test_rdma_across_two_guests", lambda scratch: [
    "bash", str(SCRIPTS / "pair.sh"), "--cxl", "none", "--net", *_mounts(),
    "--mount", f"{scratch}:/mnt/flag", "--", _RDMA_A, "--", _RDMA_B], 900, LAB_TIMEOUT="840")


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_rdma_across_two_guests(request):
    """Host A serves a region over SoftRoCE on its eth0; host B runs 3 client processes
    against it over the guests' link (a QEMU dgram netdev)."""
    _have_rdma_module()
    out = _run(request)
    assert "rdma clients: 3 passed" in out
    assert "node 2 attached to r0" in out
