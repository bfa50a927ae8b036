"""What a new user meets first: the install extras, `onespec --help`, README's serving
commands run as written against the bundled pair (completions and chat, through the official
openai client), `--chat-template`, a missing server module, the bench's short run and its
one speedup, and progress bars only on a terminal."""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest

from conftest import stop_process
from onespec.demo import HEAD_DIR, TARGET_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STARTUP_TIMEOUT_S = 90


def onespec(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onespec", *args], capture_output=True,
                          text=True, timeout=120, env=ENV, cwd=REPO, **kw)


def test_test_extra_pulls_no_gpu_compiler_and_the_server_needs_no_extra():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(reqs):
        return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs}
    extras = project["optional-dependencies"]
    assert not names(project["dependencies"] + extras["test"]) & {"triton", "numpy"}
    assert {"fastapi", "uvicorn", "pydantic", "prometheus-client"} <= \
        names(project["dependencies"])
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert 'pip install -q -e ".[test,triton-cpu,structured]"' in ci and "triton" in extras["triton-cpu"][0]


def test_help_lists_every_command_with_a_description():
    proc = onespec("--help")
    assert proc.returncode == 0, proc.stderr
    for name, summary in [("demo", "the bundled code model and its EAGLE-3 head"),
                          ("generate", "generate from one prompt"),
                          ("serve", "OpenAI-compatible HTTP server"),
                          ("bench", "decode benchmark"), ("train", "train an EAGLE-3 or P-EAGLE draft head")]:
        assert re.search(rf"^ +{name} +{re.escape(summary)}", proc.stdout, re.M), proc.stdout
    from onespec.cli import generate_parser
    text = " ".join(generate_parser().format_help().split())
    assert "--max-tokens MAX_TOKENS tokens to generate at most (default: 64)" in text
    assert "(default: None)" not in text


# ---- serving ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(argv: list[str], log_path):
    """`onespec serve` from the repository root (where README's relative paths point),
    stopped on exit; yields its log's path."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=REPO)
        try:
            yield proc
        finally:
            stop_process(proc)


def wait_ready(proc, port: int, log_path):
    import httpx
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError(f"no server after {STARTUP_TIMEOUT_S} s:\n{open(log_path).read()}")


def readme_serving_blocks() -> tuple[list[str], str]:
    """README's Serving section: (bash commands, continuation lines joined; python code)."""
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("### Serving", 1)[1].split("\n### ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return [line for line in bash.splitlines() if line.strip()], python


def test_readme_serving_commands_work_as_written(tmp_path):
    openai = pytest.importorskip("openai")
    commands, code = readme_serving_blocks()
    assert commands[0].startswith("onespec serve ") and "--port 8000" in commands[0]
    port = str(free_port())
    serve = shlex.split(commands[0].replace("8000", port))[1:]
    # a template given on the command line, over the same pair, started alongside
    template_port = free_port()
    with server([sys.executable, "-m", "onespec", *serve], tmp_path / "readme.log") as proc, \
            server([sys.executable, "-m", "onespec", "serve", "--model", TARGET_DIR, "--port",
                    str(template_port), "--max-batch-size", "4", "--chat-template",
                    "{% for m in messages %}{{ m['content'] }}:\n{% endfor %}"],
                   tmp_path / "template.log") as proc2:
        wait_ready(proc, int(port), tmp_path / "readme.log")
        curl = shutil.which("curl")
        for command in commands[1:]:
            if command.startswith("curl") and curl:
                out = subprocess.run(command.replace("8000", port), shell=True, timeout=60,
                                     capture_output=True, text=True)
                assert out.returncode == 0 and json.loads(out.stdout)["choices"][0]["text"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(code.replace("8000", port), {})
        from onespec import LLM, SamplingParams
        plain = LLM(TARGET_DIR, device="cpu", max_batch_size=4)     # a small KV pool
        completion = plain.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0]
        assert printed.getvalue().startswith(completion.outputs[0].text + "\n")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="target", max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "add a, b"}])
        ids = plain.engine.tokenizer.encode("# add a, b\n", add_special_tokens=False)
        assert chat.usage.prompt_tokens == len(ids)
        expected = plain.generate([ids], SamplingParams(max_tokens=16))[0].outputs[0].text
        assert chat.choices[0].message.content == expected

        wait_ready(proc2, template_port, tmp_path / "template.log")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{template_port}/v1", api_key="x")
        chat = client.chat.completions.create(
            model="target", max_tokens=4, messages=[{"role": "user", "content": "def f(x)"}])
        ids = plain.engine.tokenizer.encode("def f(x):\n", add_special_tokens=False)
        assert chat.usage.prompt_tokens == len(ids)


def test_serve_option_errors_are_one_line(tmp_path, capsys):
    from onespec.cli import main
    assert main(["serve", "--model", TARGET_DIR, "--chat-template", "chat.jinja"]) == 2
    assert capsys.readouterr().err == ("onespec serve: error: --chat-template 'chat.jinja' is "
                                       "neither a file nor a Jinja template\n")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m }}")
    assert main(["serve", "--model", TARGET_DIR, "--chat-template",
                 str(tmp_path / "bad.jinja")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onespec serve: error: --chat-template is not a valid Jinja "
                          "template: ") and err.count("\n") == 1, err


HIDE_FASTAPI = """
import sys
class Uninstalled:          # the import system's own error for a package that is not there
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "fastapi":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Uninstalled())
from onespec.cli import main
sys.exit(main(["serve", "--model", %r]))
"""


def test_serve_without_a_server_module_names_it_in_one_line():
    code = HIDE_FASTAPI % TARGET_DIR
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr == ("onespec serve: error: it needs 'fastapi', which is not "
                           "installed; install onespec's dependencies again: pip install -e . "
                           "(from a checkout) or pip install onespec\n")


# ---- bench -----------------------------------------------------------------------------------
def test_bench_help_gives_a_short_run_and_one_speedup(capsys):
    from onespec.cli import main
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = capsys.readouterr().out
    short = re.search(r"A short run, in seconds on a CPU:\n +(onespec bench .*?)\n\n",
                      help_text, re.S).group(1).replace("\\\n", " ")
    proc = onespec(*shlex.split(short)[1:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 0), (1, 3)]
    shown = re.search(r"\[b=1 K=3 a=4\] speedup ([\d.]+)x \(tok/s vs plain\)", proc.stderr)
    assert shown, proc.stderr
    assert float(shown.group(1)) == round(rows[1]["speedup"], 2)
    assert rows[1]["speedup"] == pytest.approx(rows[1]["tok_s"] / rows[0]["tok_s"], rel=1e-3)
    assert "it/s]" not in proc.stderr                   # no progress bars off a terminal


# ---- progress bars ---------------------------------------------------------------------------
class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_weights_bar_reaches_the_end_on_a_terminal():
    from onespec.models.loader import iter_weights
    shown = Terminal()
    with contextlib.redirect_stderr(shown):
        names = [name for name, _ in iter_weights(HEAD_DIR, desc="loading draft head")]
    assert names
    assert re.search(r"loading draft head: 100%.*1/1", shown.getvalue()), shown.getvalue()
    off = io.StringIO()
    with contextlib.redirect_stderr(off):
        list(iter_weights(HEAD_DIR, desc="loading draft head"))
    assert off.getvalue() == ""
