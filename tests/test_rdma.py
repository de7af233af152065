"""rdma: on a host without RDMA: the spec, the control protocol's errors, `cxlrt serve`'s
refusals. The data path runs in the lab's guests (tests/test_lab.py, SoftRoCE)."""

from __future__ import annotations

import json
import socket
import threading

import pytest

import cxlrt
from cxlrt import registry
from cxlrt.backends import _rdmawire as wire
from cxlrt.cli import main as cli

rdma_built = pytest.mark.skipif(
    "rdma" not in registry.available(),
    reason="rdma: is not built here (libibverbs-dev is missing; emulation/lab/setup.sh "
           "installs it)")


@pytest.mark.parametrize("path,want", [
    ("10.0.0.5:7470/rack0", ("10.0.0.5", 7470, "rack0")),
    ("host.example:1/a/b", ("host.example", 1, "a/b")),
    ("[fe80::1%eth0]:7470/r", ("fe80::1%eth0", 7470, "r")),
])
def test_paths_split_into_host_port_and_name(path, want):
    assert wire.split(path) == want


@pytest.mark.parametrize("path", ["10.0.0.5:7470", "10.0.0.5/rack0", ":7470/r",
                                  "h:port/r", "h:70000/r", "[::1]/r"])
def test_bad_paths_say_what_is_expected(path):
    with pytest.raises(ValueError, match="HOST:PORT"):
        wire.split(path)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_a_clear_refusal():
    port = _free_port()
    with pytest.raises(ConnectionRefusedError, match="is `cxlrt serve` running"):
        wire.info(f"127.0.0.1:{port}/r0")


class FakeServer:
    """Answers every message with `reply` (or stays silent), as a broken or strict
    server would."""

    def __init__(self, reply):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.seen = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        conn, _ = self.sock.accept()
        with conn, conn.makefile("rb") as f:
            line = f.readline()
            self.seen.append(json.loads(line))
            if self.reply == b"":
                return  # hang up without a word
            if self.reply is not None:
                conn.sendall(self.reply)
            f.readline()  # hold the connection until the client hangs up

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("reply,exc,match", [
    (b'{"ok":false,"kind":"not_found","error":"no region named \'x\'"}\n', FileNotFoundError,
     "no region named"),
    (b'{"ok":false,"error":"protocol version 9"}\n', wire.RdmaServerError, "refused"),
    (b"garbage\n", wire.RdmaServerError, "not a protocol message"),
    (b"", wire.RdmaServerError, "connection closed"),
])
def test_server_refusals_and_junk_are_clear_errors(reply, exc, match):
    srv = FakeServer(reply)
    try:
        with pytest.raises(exc, match=match):
            wire.info(f"127.0.0.1:{srv.port}/x", timeout=5)
        assert srv.seen[0]["op"] == "info" and srv.seen[0]["version"] == wire.VERSION
    finally:
        srv.close()


def test_a_silent_server_times_out():
    srv = FakeServer(None)
    try:
        with pytest.raises(TimeoutError, match="did not answer"):
            wire.info(f"127.0.0.1:{srv.port}/x", timeout=0.5)
    finally:
        srv.close()


def test_an_rdma_spec_without_a_region_name_says_what_is_expected():
    # Where rdma: is not built, the same open says what to install instead.
    built = "rdma" in registry.available()
    exc, msg = (ValueError, r"rdma:HOST:PORT/NAME") if built else (ImportError, "libibverbs")
    with pytest.raises(exc, match=msg):
        cxlrt.open("rdma:host:7471", node=0)


def test_rdma_is_a_known_scheme_with_an_install_hint():
    assert "rdma" in registry.known
    assert "libibverbs-dev" in registry.known["rdma"].hint


@rdma_built
def test_no_rdma_device_is_a_clear_error(region_dir):
    from cxlrt.backends.rdma import Device
    try:
        Device()
    except OSError as e:
        assert "RDMA device" in str(e)
    else:
        pytest.skip("this host has an RDMA device")


@rdma_built
def test_serve_without_an_rdma_device_exits_2_with_the_reason(region_dir, capsys):
    from cxlrt.backends.rdma import Device
    try:
        Device()
        pytest.skip("this host has an RDMA device")
    except OSError:
        pass
    spec = f"file:{region_dir}/r0"
    cxlrt.format(spec, size="4M", nodes=2)
    assert cli(["serve", spec, "--listen", "127.0.0.1:0"]) == 2
    assert "RDMA device" in capsys.readouterr().err


def test_serve_help_names_the_client_spec(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "rdma:HOST:PORT/NAME" in out and "--listen" in out


@pytest.mark.parametrize("listen", ["7470", "host:", "host:99999"])
def test_serve_refuses_a_bad_listen_address(listen, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["serve", "file:/nonexistent", "--listen", listen])
    assert e.value.code == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_region_names_come_from_the_medium_or_are_given():
    from cxlrt.backends.rdma_serve import parse_region_arg
    assert parse_region_arg("file:/dev/shm/rack0") == ("rack0", "file:/dev/shm/rack0")
    assert parse_region_arg("kv=dax:/dev/dax0.0") == ("kv", "dax:/dev/dax0.0")
    assert parse_region_arg("dax:/dev/dax0.0?sync=auto") == ("dax0.0", "dax:/dev/dax0.0?sync=auto")


@rdma_built
@pytest.mark.parametrize("args,msg", [
    (["file:/nonexistent-dir/x"], "no region at"),
    (["nvme:/dev/x"], "unknown region scheme"),
    (["rdma:h:1/x"], "serve a local region"),
    (["a=file:/x", "a=file:/y"], "two regions have one name"),
])
def test_serve_tells_a_bad_region_before_anything_else(args, msg, capsys):
    assert cli(["serve", *args, "--listen", "127.0.0.1:0"]) == 2
    assert msg in capsys.readouterr().err


class ScriptedServer:
    """Answers the client's messages in order with `replies`, then holds the line."""

    def __init__(self, replies):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.replies = list(replies)
        self.seen = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        conn, _ = self.sock.accept()
        with conn, conn.makefile("rb") as f:
            for reply in self.replies:
                self.seen.append(json.loads(f.readline()))
                conn.sendall(reply)
            f.readline()

    def close(self):
        self.sock.close()


ATTACHED = (b'{"ok":true,"size":16777216,"addr":4096,"rkey":7,"qpn":9,"psn":1,'
            b'"gid":"00000000000000000000ffff7f000001"}\n')


@pytest.mark.parametrize("claim_reply,exc", [
    (b'{"ok":true}\n', None),
    (b'{"ok":false,"error":"node 1 of r0 is held by host 00000000deadbeef"}\n',
     wire.ClaimRefused),
])
def test_a_reconnect_claims_its_node_in_the_attach_handshake(claim_reply, exc):
    from cxlrt.liveness import claim_id
    srv = ScriptedServer([ATTACHED, claim_reply])
    try:
        args = dict(node=1, qpn=5, psn=6, gid="00" * 16, timeout=5, claim=4)
        if exc is None:
            conn, reply = wire.attach(f"127.0.0.1:{srv.port}/r0", **args)
            conn.close()
            assert reply["rkey"] == 7
        else:
            with pytest.raises(exc, match="held by host"):
                wire.attach(f"127.0.0.1:{srv.port}/r0", **args)
        attach, claim = srv.seen
        assert attach["op"] == "attach" and claim["op"] == "claim"
        assert claim["node"] == 1 and claim["nodes"] == 4
        assert claim["host"] == attach["host"] == f"{claim_id():016x}"
    finally:
        srv.close()


@pytest.mark.parametrize("how,match", [("server hangs up", "closed during 'claim'"),
                                       ("our end shut down", "closed before 'claim'")])
def test_a_connection_that_ends_unanswered_is_lost_not_refused(how, match):
    """A claim whose connection ends (an outage) is ConnectionLost, which the client
    rides out through the next attachment; a refusal is not (next test)."""
    srv = ScriptedServer([ATTACHED])  # answers the attach, reads the claim, hangs up
    try:
        conn, _ = wire.attach(f"127.0.0.1:{srv.port}/r0", node=1, qpn=5, psn=6,
                              gid="00" * 16, timeout=5)
        threading.Thread(target=conn.wait_closed, daemon=True).start()
        if how == "our end shut down":
            conn.sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(wire.ConnectionLost, match=match):
            conn.ask({"op": "claim", "node": 1, "nodes": 4, "host": "0" * 16}, 5)
        conn.close()
    finally:
        srv.close()


def test_a_refused_claim_is_not_a_lost_connection():
    srv = ScriptedServer([ATTACHED, b'{"ok":false,"error":"node 1 of r0 is held by host x"}\n'])
    try:
        conn, _ = wire.attach(f"127.0.0.1:{srv.port}/r0", node=1, qpn=5, psn=6,
                              gid="00" * 16, timeout=5)
        threading.Thread(target=conn.wait_closed, daemon=True).start()
        with pytest.raises(wire.RdmaServerError, match="held by host") as e:
            conn.ask({"op": "claim", "node": 1, "nodes": 4, "host": "0" * 16}, 5)
        assert not isinstance(e.value, wire.ConnectionLost)
        conn.close()
    finally:
        srv.close()


def test_claim_id_is_the_hostname_and_this_boot(monkeypatch):
    """Cloned VMs share a hostname but not a boot: their claims of one node differ."""
    from cxlrt import liveness
    here = liveness.claim_id()
    assert here == liveness.claim_id()
    monkeypatch.setattr(liveness, "boot_id", lambda: b"\x01" * 16)
    assert liveness.claim_id() != here
