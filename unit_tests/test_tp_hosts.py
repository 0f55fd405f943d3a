"""TP across hosts on the CPU (issue 49, item 1): the flags' checks, the rendezvous (fingerprints compared,
a host that never joins, an address that never answers), the hosts' liveness, and two simulated hosts (two
launcher processes on 127.0.0.1, gloo over loopback) that serve the tokens of one host and end together when
one of them is killed."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch.distributed as dist

from autoprofile import cli, launch
from autoprofile.config import ServerConfig, validate
from autoprofile.tp import rendezvous
from autoprofile.tp.rendezvous import Hosts, HostWatch, RendezvousError

TINY = ["--model", "tiny", "--dtype", "float32", "--attention_backend", "torch"]
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}  # gloo's pairs on loopback, as the store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- bad flags, before any GPU work
@pytest.mark.parametrize("argv, flag, works", [
    (["--tp", "2", "--nnodes", "2"], "--dist_init_addr", "try --dist_init_addr 10.0.0.1:29500"),
    (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:29500", "--node_rank", "2"], "--node_rank",
     "try --node_rank 1"),
    (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:29500", "--node_rank", "-1"],
     "--node_rank", "try --node_rank 0"),
    (["--tp", "3", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:29500"], "--tp", "try --tp 4"),
    (["--tp", "2", "--nnodes", "0"], "--nnodes", "try --nnodes 1"),
    (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "host0"], "--dist_init_addr",
     "try --dist_init_addr 10.0.0.1:29500"),
    (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "host0:70000"], "--dist_init_addr", "HOST:PORT"),
    (["--tp", "2", "--dist_init_addr", "127.0.0.1:29500"], "--dist_init_addr", "needs --nnodes > 1"),
    (["--tp", "2", "--nnodes", "2", "--dist_init_addr", "127.0.0.1:29500", "--dist_timeout", "0"],
     "--dist_timeout", "try --dist_timeout 300"),
])
@pytest.mark.parametrize("command", ["serve", "profile"])
def test_a_bad_host_flag_is_refused_naming_it_and_what_works(command, argv, flag, works, mocker, capsys):
    gpu = mocker.patch("autoprofile.cli._gpu_present", return_value=True)
    assert cli.main([command, *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: ") and works in err, err
    assert not gpu.called  # refused before anything looked for a GPU


def test_ipv6_and_plain_addresses_parse():
    from autoprofile.config import parse_dist_addr
    assert parse_dist_addr("[::1]:29500") == ("::1", 29500)
    assert parse_dist_addr("node-0.cluster:1234") == ("node-0.cluster", 1234)
    cfg = validate(ServerConfig(model="llama-3.1-8b", tp=4, nnodes=2, node_rank=1,
                                dist_init_addr="10.0.0.1:29500", report_dir=None))
    hosts = launch.hosts_of(cfg)
    assert hosts.addr == ("10.0.0.1", 29500) and list(hosts.ranks(4)) == [2, 3]


def test_a_host_without_gpus_for_its_ranks_is_refused_naming_tp(mocker, capsys):
    mocker.patch("autoprofile.cli._gpu_present", return_value=True)
    mocker.patch("torch.cuda.device_count", return_value=1)
    argv = ["serve", "--model", "llama-3.1-8b", "--tp", "4", "--nnodes", "2", "--dist_init_addr",
            "127.0.0.1:1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tp: --tp 4 over --nnodes 2 runs 2 rank(s) on each host") and \
        "this host sees 1 GPU(s)" in err and "try --tp 2" in err and "--nnodes 4" in err, err


def test_plan_with_nnodes_says_hosts_times_gpus_and_per_rank(capsys):
    argv = ["plan", "--model", "deepseek-v3", "--gpu", "h100", "--tp", "16", "--nnodes", "2"]
    assert cli.main(argv) in (0, 2)
    out = capsys.readouterr().out
    assert "per TP rank (--tp 16 over --nnodes 2: 2 hosts x 8 GPUs)" in out, out[:500]
    assert "MLA latent replicated on all 16 ranks" in out, out
    assert cli.main([*argv, "--json"]) in (0, 2)
    assert '"nnodes": 2' in capsys.readouterr().out


def test_plan_refuses_a_tp_that_does_not_split_over_the_hosts(capsys):
    assert cli.main(["plan", "--gpu", "h100", "--tp", "2", "--nnodes", "4"]) == 2
    assert capsys.readouterr().err.startswith("error: --tp: --tp 2 does not split over --nnodes 4 hosts")


# ---------------------------------------------------------------- the rendezvous
def _meet(hosts: Hosts, fp: dict, world: int, out: dict, key: int | None = None) -> None:
    key = hosts.node_rank if key is None else key
    try:
        out[key] = rendezvous.meet(hosts, fp, world)
    except RendezvousError as e:
        out[key] = str(e)


def _rendezvous(fps: list[dict], timeout_s: float = 30.0, port: int | None = None,
                ranks: list[int] | None = None) -> dict:
    """Every host's meet() on its own thread: its index in fps -> its store, or its error text."""
    port = port or _free_port()
    out: dict = {}
    threads = [threading.Thread(target=_meet, args=(Hosts(len(fps), n, ("127.0.0.1", port), timeout_s), fp,
                                                   2 * len(fps), out, i))
               for i, (n, fp) in enumerate(zip(ranks or range(len(fps)), fps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rendezvous never ended"
    return out


CFG = ServerConfig(model="tiny", tp=4, nnodes=2, dist_init_addr="127.0.0.1:1", max_req_total_len=256,
                   report_dir=None)


def test_hosts_with_the_same_fingerprint_meet_and_share_one_store():
    fp = rendezvous.fingerprint(CFG)
    host1 = rendezvous.fingerprint(CFG.replace(node_rank=1, port=9000, served_model_name="other"))
    assert fp == host1  # host-local flags (its index, HTTP) are not compared
    out = _rendezvous([fp, host1])
    assert isinstance(out[0], dist.TCPStore) and isinstance(out[1], dist.TCPStore), out
    out[1].set("x", "from host 1")
    assert out[0].get("x") == b"from host 1"


@pytest.mark.parametrize("change, named", [
    (dict(max_req_total_len=512), "--max_req_total_len is 256 on host 0 but 512 on host 1"),
    (dict(model="tiny-moe"), "--model differs: its config's"),
    (dict(seed=7), "--seed is 0 on host 0 but 7 on host 1"),
])
def test_a_host_with_other_flags_or_model_is_refused_on_every_host_naming_the_difference(change, named):
    out = _rendezvous([rendezvous.fingerprint(CFG), rendezvous.fingerprint(CFG.replace(**change))])
    assert isinstance(out[0], str) and isinstance(out[1], str), out
    for text in out.values():
        assert text.startswith("host refused at the rendezvous: ") and named in text, text


def test_a_host_running_another_command_is_refused_naming_both():
    out = _rendezvous([rendezvous.fingerprint(CFG, "serve"), rendezvous.fingerprint(CFG, "profile")])
    for text in out.values():
        assert "host 0 runs `autoprofile serve`, host 1 `autoprofile profile`" in text, out


def test_a_host_with_another_code_version_is_refused_naming_both_versions():
    fp = rendezvous.fingerprint(CFG)
    other = {**fp, "code": {**fp["code"], "git": "v0.0.9-3-gabc1234"}}
    out = _rendezvous([fp, other])
    assert "the code differs" in out[0] and "v0.0.9-3-gabc1234" in out[0], out
    assert "install the same version on every host" in out[1], out


def test_a_host_that_never_joins_ends_host_0_with_a_clear_error():
    out: dict = {}
    _meet(Hosts(2, 0, ("127.0.0.1", _free_port()), 1.0), rendezvous.fingerprint(CFG), 4, out)
    assert out[0].startswith("host 1 (ranks 2-3) never joined the rendezvous at 127.0.0.1:") and \
        "within 1 s (--dist_timeout)" in out[0] and "--node_rank 1" in out[0], out


def test_an_address_where_nothing_answers_ends_the_joining_host_with_a_clear_error():
    out: dict = {}
    _meet(Hosts(2, 1, ("127.0.0.1", _free_port()), 1.0), rendezvous.fingerprint(CFG), 4, out)
    assert out[1].startswith("--dist_init_addr: nothing answered at 127.0.0.1:") and \
        "(--dist_timeout)" in out[1] and "start host 0 (--node_rank 0)" in out[1], out


def test_two_hosts_claiming_one_node_rank_the_second_is_refused():
    fp = rendezvous.fingerprint(CFG)
    port = _free_port()
    out = _rendezvous([fp, fp, fp], timeout_s=3.0, port=port, ranks=[0, 1, 1])  # nnodes 3: no host 2
    assert "host 2 (ranks 4-5) never joined" in out[0], out
    refused = [t for t in out.values() if isinstance(t, str) and t.startswith("--node_rank: another host")]
    assert refused, out


def test_serve_on_a_joining_host_whose_address_never_answers_exits_1_naming_the_flag(mocker, capsys):
    mocker.patch("autoprofile.cli._gpu_present", return_value=True)
    mocker.patch("torch.cuda.device_count", return_value=1)
    argv = ["serve", *TINY, "--tp", "2", "--nnodes", "2", "--node_rank", "1", "--dist_init_addr",
            f"127.0.0.1:{_free_port()}", "--dist_timeout", "1"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --dist_init_addr: nothing answered at 127.0.0.1:"), err


# ---------------------------------------------------------------- liveness
def test_a_host_whose_launcher_stops_beating_is_posted_once_as_fatal_and_a_done_host_never():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    watches = [HostWatch(store, Hosts(3, n), 6, lost_s=0.5) for n in range(3)]
    posted: list = []
    watches[2].tick(posted.append)
    watches[2].done()  # host 2 ended cleanly: its silence is no failure
    deadline = time.monotonic() + 30
    while not posted and time.monotonic() < deadline:  # host 1 beats no more
        watches[0].tick(lambda rank, text: posted.append((rank, text)))
        time.sleep(0.05)
    watches[0].tick(lambda rank, text: posted.append((rank, text)))
    assert posted == [(2, "host 1 (ranks 2-3) is gone: its launcher sent no heartbeat for 0.5 s (the host "
                          "died, its launcher was killed, or the network to it failed)")]


# ---------------------------------------------------------------- launch() across hosts, in threads
def _where(guard):
    import torch
    x = torch.tensor([float(guard.rank)])
    torch.distributed.all_reduce(x, group=guard.control)  # one group over both hosts
    return guard.rank, guard.world, os.environ["LOCAL_RANK"], x.item()


def test_each_hosts_launcher_runs_its_ranks_with_global_ranks_and_local_devices():
    out = _two_hosts(_where, 4)
    assert all(o.ok for n in range(2) for o in out[n]), out
    assert [o.value for o in out[0]] == [(0, 4, "0", 6.0), (1, 4, "1", 6.0)]
    assert [o.value for o in out[1]] == [(2, 4, "0", 6.0), (3, 4, "1", 6.0)]


def _two_hosts(target, world: int, *args) -> dict:
    """launch(target) of 2 hosts, each on a thread of this process: node rank -> its ranks' Outcomes."""
    port = _free_port()
    out: dict = {}

    def host(n: int) -> None:
        out[n] = launch.launch(target, world, args, device="cpu", timeout_s=120, env=LOOPBACK,
                               hosts=Hosts(2, n, ("127.0.0.1", port), 60.0),
                               fingerprint=rendezvous.fingerprint(CFG))
    threads = [threading.Thread(target=host, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads)
    return out


def test_the_profile_agrees_across_hosts_and_retries_on_both_after_one_host_failed_inside_a_collective():
    from unit_tests.test_tp import _profile_with_abort
    out = _two_hosts(_profile_with_abort, 2)  # rank 1 (host 1) raises inside its decode stress's all-reduce
    assert all(o.ok for n in range(2) for o in out[n]), out
    (tok0, att0, err0, new0, _), (tok1, att1, err1, new1, _) = out[0][0].value, out[1][0].value
    assert tok0 == tok1 and att0 == att1 == 2 and err0 == err1  # one MIN, one retry, on both hosts
    assert "rank 1: OutOfMemoryError: injected" in err0[0] and new0 and new1


def test_a_rank_takes_the_gpu_of_its_local_rank(monkeypatch, mocker):
    from autoprofile.engine.runner import runner_device
    mocker.patch("torch.cuda.is_available", return_value=True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert str(runner_device(3)) == "cuda:1"  # global rank 3 is the second rank of host 1
    monkeypatch.delenv("LOCAL_RANK")
    assert str(runner_device(1)) == "cuda:1"


# ---------------------------------------------------------------- two simulated hosts (processes)
def _hosts_env() -> dict:
    return {**LOOPBACK, "AUTOPROFILE_TEST_RELEASE": ""}


def _serve_hosts(port: int, tp: int = 2):
    from unit_tests.test_serve_process import _start
    addr = f"127.0.0.1:{port}"
    return [_start(["unit_tests.tp_cpu_boot", "0", "--tp", str(tp), "--nnodes", "2", "--node_rank", str(n),
                    "--dist_init_addr", addr], _hosts_env()) for n in range(2)]


PROMPTS = [[5, 6, 7, 8], [9] * 12, list(range(30, 70))]


def _tokens(url: str) -> list:
    from unit_tests.test_serve_process import _post
    out = []
    for ids in PROMPTS:
        status, body = _post(f"{url}/generate", {"input_ids": [ids], "max_new_tokens": 8})
        assert status == 200, body
        out.append(body["output_ids"][0])
    return out


@pytest.mark.slow
def test_two_simulated_hosts_serve_the_tokens_of_one_host_at_the_same_tp_and_stop_together():
    from unit_tests.test_serve_process import _start, _stop, _url, _wait_ready
    one, lines = _start(["unit_tests.tp_cpu_boot", "0"], _hosts_env())
    try:
        url = _url(one, lines)
        _wait_ready(url)
        want = _tokens(url)
        one.send_signal(signal.SIGTERM)
        assert one.wait(timeout=60) == 0, "".join(lines[-40:])
    finally:
        _stop(one)
    (h0, l0), (h1, l1) = _serve_hosts(_free_port())
    try:
        url = _url(h0, l0)
        _wait_ready(url)
        assert _tokens(url) == want
        assert any(" rank1 " in ln for ln in l1) and not any(" rank1 " in ln for ln in l0)  # rank 1 on host 1
        h0.send_signal(signal.SIGTERM)  # rank 0 stops every rank, on both hosts
        assert h0.wait(timeout=60) == 0, "".join(l0[-40:])
        assert h1.wait(timeout=60) == 0, "".join(l1[-40:])
    finally:
        _stop(h0)
        _stop(h1)


@pytest.mark.slow
@pytest.mark.parametrize("busy", [True, False], ids=["mid-generation", "idle"])
def test_a_host_killed_mid_serve_ends_every_rank_with_one_message_and_no_orphan(busy):
    import psutil
    from unit_tests.test_serve_process import _post, _stop, _url, _wait_ready
    (h0, l0), (h1, l1) = _serve_hosts(_free_port())
    try:
        url = _url(h0, l0)
        _wait_ready(url)
        ranks = psutil.Process(h0.pid).children(recursive=True)
        answers: list = []
        if busy:
            threading.Thread(target=lambda: answers.append(_post(f"{url}/generate", {
                "input_ids": [[5, 6, 7, 8]], "max_new_tokens": 240})), daemon=True).start()
            time.sleep(1.0)  # NOTE: a step or two in flight
        t0 = time.monotonic()
        os.killpg(h1.pid, signal.SIGKILL)  # the whole host: its launcher and its rank
        code = h0.wait(timeout=90)
        took = time.monotonic() - t0
        text = "".join(l0)
    finally:
        _stop(h0)
        _stop(h1)
    assert code == 1, text[-3000:]
    assert took < 60, took
    assert "host 1 (rank 1) is gone: its launcher sent no heartbeat" in text, text[-3000:]
    assert text.rstrip().splitlines()[-1].startswith("tensor-parallel serving stopped: rank 1: host 1"), \
        text[-2000:]
    assert not psutil.wait_procs(ranks, timeout=10)[1]  # host 0's rank ended too
