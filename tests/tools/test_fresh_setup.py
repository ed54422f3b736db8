"""The README's first command on a fresh virtual environment gives a working `pagedllm serve`.

A new user runs `bash tools/demo.sh` and then `pagedllm serve` as the README shows: the server's dependencies must
have come with that set-up. This builds a virtual environment without this Python's packages, runs the README's
command in it, then serves the bundled demo model from it and completes a prompt with the openai client.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv

from tests.entrypoints.server_utils import REPO_ROOT, RemoteServer


def _readme_first_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO_ROOT / "README.md").read_text(), flags=re.S)
    return blocks[0].strip()


def test_readme_first_command_sets_up_a_server(tmp_path):
    command = _readme_first_command()
    assert command.startswith("bash tools/demo.sh"), command
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)  # no system site packages: only what the set-up installs
    bin_dir = env_dir / "bin"
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHON", "PYTHONHOME", "PYTHONSTARTUP")
    }
    env.update(VIRTUAL_ENV=str(env_dir), PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    demo = subprocess.run(
        ["bash", "-c", command], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-4000:]
    assert re.search(r"\[64 tokens in", demo.stdout + demo.stderr), (demo.stdout + demo.stderr)[-2000:]
    probe = subprocess.run(
        [str(bin_dir / "python"), "-c", "import sys, pagedllm, fastapi, zmq; print(sys.prefix)"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert probe.returncode == 0 and probe.stdout.strip() == str(env_dir), probe.stderr
    assert sys.prefix != str(env_dir)

    server = RemoteServer(None, tmp_path / "serve.log", command=[str(bin_dir / "pagedllm")], env=env)
    try:
        client = server.openai_client()
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=8, temperature=0)
    finally:
        assert server.stop() == 0, server.log()
    assert out.usage.completion_tokens == 8 and out.choices[0].text
