"""``aiocb serve --replicas N``: its refusals, and two replicas of the bundled model from the command line."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from aiocb.cli.serve import add_serve_arguments, run_serve
from aiocb.default_model import DEFAULT_MODEL_PATH
from aiocb.ray_serve import REPLICA_HEADER
from tests.distributed.launch import free_port

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_replica_counts_are_parsed() -> None:
    assert parse("--replicas", "3").replicas == 3
    assert parse("--replicas", "auto").replicas == "auto"
    assert parse().replicas is None
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit):
            parse("--replicas", bad)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--ray-address", "auto"), "--ray-address needs --replicas"),
        (("--routing", "power_of_two"), "--routing needs --replicas"),
        (("--ingress-replicas", "2"), "--ingress-replicas needs --replicas"),
        (("--replicas", "2", "--ingress-replicas", "0"), None),
        (("--autoscaling-config", "{}"), "--autoscaling-config needs --replicas"),
        (("--tensor-parallel-size", "2"), "--tensor-parallel-size needs --replicas"),
        (("--replicas", "2", "--api-workers", "2"), "--api-workers does not apply"),
        (("--replicas", "2", "--loop", "asyncio"), "--loop is uvicorn's"),
        (("--replicas", "2", "--max-connections", "10"), "--max-connections is uvicorn's"),
        (("--replicas", "2", "--port", "0"), "--port 0"),
        (("--replicas", "2", "--send-timeout", "5"), "--send-timeout does not apply to --replicas"),
        (("--replicas", "2", "--autoscaling-config", "{}"), "--autoscaling-config goes with --replicas auto"),
        (("--replicas", "auto", "--autoscaling-config", '{"max_replicas": 0}'), "autoscaling_config"),
        (("--replicas", "2", "--routing", "power_of_two", "--log-level", "nope"), None),
        (("--replicas", "2", "--tensor-parallel-size", "2"), "model path"),
        (("/no/such/model", "--replicas", "2"), "cannot load /no/such/model: no such directory"),
        (("--replicas", "2", "--device", "cuda:99"), "--device cuda:99: this machine has"),
    ],
)
def test_flags_that_do_not_fit_replicas_are_refused_before_ray_starts(
    argv: tuple[str, ...], message: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    if message is None:  # argparse's own refusal
        with pytest.raises(SystemExit):
            parse(*argv)
        return
    assert run_serve(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_the_replica_flags_reach_the_app(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The app is built once before Ray starts, every option checked: the flags are its arguments."""
    import aiocb.ray_serve
    from aiocb.errors import InvalidConfigError

    built: list[dict[str, object]] = []

    def build_app(model: str, **options: object) -> None:
        built.append(options)
        raise InvalidConfigError("checked")  # (the command ends there, before Ray starts)

    monkeypatch.setattr(aiocb.ray_serve, "build_app", build_app)
    assert run_serve(parse("--replicas", "3", "--ingress-replicas", "2", "--routing", "power_of_two")) == 2
    assert run_serve(parse("--replicas", "auto", "--chat-template", "{{ messages }}")) == 2
    assert [(b["num_replicas"], b["num_ingress_replicas"], b["routing"], b["chat_template"]) for b in built] == [
        (3, 2, "power_of_two", None),
        ("auto", 1, "prefix_affinity", "{{ messages }}"),
    ]
    assert "aiocb serve: checked" in capsys.readouterr().err


def test_a_port_in_use_is_refused_in_one_line_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import ray

    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        assert run_serve(parse("--replicas", "1", "--port", str(port))) == 2
    assert not ray.is_initialized()
    err = capsys.readouterr().err
    assert err.startswith(f"aiocb serve: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1, err


def test_a_proxy_that_cannot_bind_ends_the_command_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The port taken between the check and Ray Serve's proxy binding it: Ray's error, told in one line."""
    import ray
    from ray import serve

    import aiocb.cli.replicas

    stopped: list[str] = []

    def start(**_: object) -> None:
        raise RuntimeError("Traceback (most recent call last):\n  ...\nFailed to bind to address '127.0.0.1:1'.")

    monkeypatch.setattr(aiocb.cli.replicas, "listen", lambda args: [])
    monkeypatch.setattr(ray, "init", lambda **_: None)
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append("ray"))
    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "shutdown", lambda: stopped.append("serve"))
    assert run_serve(parse("--replicas", "1", "--port", "1")) == 2
    assert capsys.readouterr().err == (
        "aiocb serve: Ray Serve's proxy did not start on 127.0.0.1:1: Failed to bind to address '127.0.0.1:1'.\n"
    )
    assert stopped == ["serve", "ray"]


def test_replicas_on_a_cluster_are_not_checked_against_this_machine() -> None:
    """Its nodes have the GPUs and the model path, which this machine may lack (a replica
    checks its device where it runs)."""
    from aiocb.cli.replicas import replica_problems
    from aiocb.cli.serve import flag_problems

    args = parse("/on/the/nodes", "--replicas", "2", "--ray-address", "ray://head:10001", "--device", "cuda:99")
    assert flag_problems(args) + replica_problems(args) == []


def _wait_ready(url: str, process: subprocess.Popen[str], log: Path) -> None:
    """Until ``url`` answers ``/ready`` (the replicas are up); fails if the command exits or takes 3 minutes."""
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the replicas did not come up:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


@pytest.mark.slow  # a Ray cluster and two replicas started from scratch: ~40 s of the default session
def test_two_replicas_from_the_command_line(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "aiocb.cli.serve", "--replicas", "2", "--port", str(port)]
    command += ["--torch-threads", "1", "--page-size", "16", "--num-blocks", "256", "--shutdown-timeout", "5"]
    template = tmp_path / "chat.jinja"  # (read here: the replicas get its text)
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    command += ["--chat-template", str(template)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process, log)
        body = {"model": "pycode-tiny", "prompt": "def add(a, b):\n", "max_tokens": 4, "temperature": 0}
        seen: set[str] = set()
        for _ in range(40):
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            seen.add(response.headers[REPLICA_HEADER])
            if len(seen) == 2:
                break
        assert len(seen) == 2, "both replicas answered"
        tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
        chat = {"messages": [{"role": "user", "content": "Hello"}]}
        replicas_rendered = set()
        for _ in range(40):
            response = httpx.post(f"{url}/tokenize", json=chat, timeout=60)
            assert response.json()["tokens"] == tokenizer.encode("user: Hello\n", add_special_tokens=False)
            replicas_rendered.add(response.headers[REPLICA_HEADER])
            if len(replicas_rendered) == 2:
                break
        assert len(replicas_rendered) == 2, "both replicas rendered with the template"
        # SIGTERM drains: running requests go on (for up to --shutdown-timeout) through
        # Ray Serve's proxy, which stays until the app is deleted.
        outcomes: dict[str, Any] = {}

        def short() -> None:
            request = {**body, "max_tokens": 40, "ignore_eos": True}
            outcomes["short"] = httpx.post(f"{url}/v1/completions", json=request, timeout=60).status_code

        def streamed() -> None:
            request = {**body, "max_tokens": 900, "ignore_eos": True, "n": 2, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=60) as response:
                outcomes["stream"] = [line for line in response.iter_lines() if line]

        clients = [threading.Thread(target=short), threading.Thread(target=streamed)]
        for client in clients:
            client.start()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(timeout=60)
        assert outcomes.get("short") == 200, outcomes
        assert outcomes["stream"][-1] == "data: [DONE]", outcomes["stream"][-3:]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    output = log.read_text()
    assert process.returncode == 0, output[-4000:]
    assert "with 2 replicas on Ray Serve" in output


@pytest.mark.slow
def test_replicas_on_a_running_cluster_leave_it_running(tmp_path: Path) -> None:
    """``--ray-address``: the app runs on a cluster started apart (``ray start --head``), and
    stopping the command deletes the app, not the cluster or its Serve instance; an app of
    its name that it did not deploy is neither replaced nor deleted."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    gcs_port, http_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["RAY_AUTH_MODE"] = "disabled"  # the test's own cluster, on loopback: no token to hand around
    head = [ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port), "--num-cpus", "4"]
    head += ["--include-dashboard", "false"]
    subprocess.run([*head, "--disable-usage-stats"], check=True, env=env, capture_output=True, timeout=120)
    address = f"127.0.0.1:{gcs_port}"
    try:
        command = [sys.executable, "-m", "aiocb.cli.serve", "--replicas", "2", "--ray-address", address]
        command += ["--port", str(http_port), "--torch-threads", "1", "--page-size", "16", "--num-blocks", "256"]
        log = tmp_path / "serve.log"
        with log.open("w") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{http_port}"
        try:
            _wait_ready(url, process, log)
            body = {"model": "pycode-tiny", "prompt": "def add(a, b):\n", "max_tokens": 4}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=90)
        assert process.returncode == 0, log.read_text()[-4000:]
        probe = f"import ray; from ray import serve; ray.init(address={address!r}); "
        probe += "print(sorted(serve.status().applications))"
        apps = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert apps.returncode == 0, apps.stderr[-2000:]
        assert apps.stdout.strip().splitlines()[-1] == "[]", "the app was deleted; the cluster still answers"
        other = probe.replace("print(sorted(serve.status().applications))", "")
        other += "serve.run(serve.deployment(lambda request: 'theirs').bind(), name='aiocb', route_prefix='/other')"
        deployed = subprocess.run([sys.executable, "-c", other], env=env, capture_output=True, text=True, timeout=120)
        assert deployed.returncode == 0, deployed.stderr[-2000:]
        refused = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
        assert refused.returncode == 2 and "an app named 'aiocb' already runs" in refused.stderr, refused.stderr[-2000:]
        apps = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert apps.stdout.strip().splitlines()[-1] == "['aiocb']", "theirs is left running"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
