"""Every command refuses bad input with one line `<prog>: error: ...` and exit code 2 (issue 17).

Most cases call each command's ``main`` in this process (same code path as the command line,
cheaper); a few run the real command line in a subprocess to hold the exit code and the absence
of any traceback end to end. All use tiny-gpt2 (the default model is never loaded).
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import cli, invert, run
from benchmarks.experiments import noise, speed
from sipit.models import GGUF_MAGIC

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny-gpt2"]
LONG_TEXT = "word " * 400  # far beyond tiny-gpt2's 256-token context


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"model_type": "gpt2", ')
    (root / "notmodel").mkdir()
    (root / "notmodel" / "tokenizer.model").write_bytes(b"\x00\x01")
    (root / "corrupt.gguf").write_bytes(GGUF_MAGIC + b"\x03\x00\x00\x00" + bytes(range(255, 200, -1)))
    return {name: str(root / name) for name in ("broken", "notmodel", "corrupt.gguf")}


def error_line(main, argv, capsys) -> str:
    """Run ``main(argv)``; assert exit code 2, no traceback and exactly one error line; return it."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert err.rstrip().splitlines()[-1] == lines[0]
    return lines[0]


CASES = [
    (noise.main, ["--sigmas", "bogus"], "argument --sigmas: must be a finite number >= 0, got 'bogus'"),
    (noise.main, ["--sigmas=-1"], "argument --sigmas: must be a finite number >= 0, got '-1'"),
    (noise.main, ["--sigmas", "0,nan"], "must be a finite number >= 0, got 'nan'"),
    (noise.main, ["--n-prompts", "0"], "argument --n-prompts: must be an integer >= 1, got 0"),
    (noise.main, ["--decoders", "nn,map"], "unknown ['nn']: choose from nn-shortlist"),
    (noise.main, ["--model", "does-not-exist"], "unknown model 'does-not-exist'"),
    (noise.main, TINY + ["--layer", "99"], "layer 99 out of range: this model has layers 0..4"),
    (noise.main, TINY + ["--length", "300"], "--length: 300 positions, more than the model's context length of 256"),
    (speed.main, ["--layers", "bogus"], "argument --layers: 'bogus' is neither first, middle, last nor a layer number"),
    (speed.main, TINY + ["--layers", "first,99"], "--layers: layer 99 out of range"),
    (speed.main, ["--n-prompts", "0"], "argument --n-prompts: must be an integer >= 1, got 0"),
    (speed.main, ["--model", "does-not-exist"], "unknown model 'does-not-exist'"),
    (speed.main, TINY + ["--length", "300"], "context length of 256"),
    (invert.main, ["hello", "--max-tokens", "-1"], "argument --max-tokens: must be an integer >= 1, got -1"),
    (invert.main, ["hello", "--max-tokens", "0"], "must be an integer >= 1, got 0"),
    (invert.main, [LONG_TEXT] + TINY, "positions, more than the model's context length of 256 tokens: "
                                      "shorten it or keep its first tokens with --max-tokens 256"),
    (run.main, TINY + ["--defense", "tying", "--tie-groups", "100000", "--no-tracking"],
     "--defense tying:groups=100000: groups=100000 exceeds the vocabulary size 512"),
    (run.main, TINY + ["--prompts", "random", "--length", "300", "--no-tracking"], "--length: 300 positions"),
    (run.main, TINY + ["--defense", "noise", "--sigma", "nan"], "argument --sigma: must be a finite number >= 0"),
    (run.main, TINY + ["--n-prompts", "0"], "argument --n-prompts: must be an integer >= 1, got 0"),
]


@pytest.mark.parametrize("main, argv, message", CASES, ids=[f"{m.__module__}:{' '.join(a)[:40]}" for m, a, _ in CASES])
def test_bad_option_is_one_error_line(main, argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(cli.RESULTS_ENV, str(tmp_path / "results"))
    line = error_line(main, argv, capsys)
    assert message in line
    assert line.startswith(f"python -m {main.__module__}: error: ")
    assert not (tmp_path / "results").exists()  # refused before anything was written


@pytest.mark.parametrize("which, message", [
    ("broken", "not a loadable model directory"),
    ("notmodel", "not a model directory"),
    ("corrupt.gguf", "corrupt GGUF file"),
])
def test_bad_model_path_is_one_error_line(bad_models, which, message, capsys):
    for main, argv in ((invert.main, ["hello"]), (speed.main, []), (noise.main, [])):
        line = error_line(main, argv + ["--model", bad_models[which]], capsys)
        assert message in line and bad_models[which] in line


def test_invert_max_tokens_keeps_exactly_n_tokens(capsys):
    code = invert.main(["Hello world, this is a test.", "--model", "tiny-gpt2", "--max-tokens", "3",
                        "--policy", "gradient"])
    out = capsys.readouterr().out
    assert code == 0 and "exact recovery: True" in out
    rows = [line.split()[0] for line in out.splitlines() if re.match(r"\s+\d+ ", line)]
    assert rows == ["0", "1", "2"], out


def test_noise_help_and_behaviour_agree_on_the_default_sigma():
    from benchmarks.config import RunConfig

    help_text = run.build_parser().format_help()
    params = RunConfig.from_options(defense="noise").chain().params()
    assert params["relative_to"] == "rms"
    assert f"neither --sigma nor --sigma-rel: --sigma-rel {params['sigma']:g}" in " ".join(help_text.split())
    assert "(default: None)" not in " ".join(help_text.split()).split("--sigma ")[1].split("--placement")[0]
    explicit = RunConfig.from_options(defense="noise", sigma=0.1).chain().params()
    assert explicit["sigma"] == 0.1 and explicit["relative_to"] == "abs"
    assert RunConfig.from_options(defense="noise:sigma=0.1,relative_to=abs").chain().params() == explicit


def test_default_out_dir_is_the_repository_results_folder_wherever_the_command_runs(tmp_path, monkeypatch):
    monkeypatch.delenv(cli.RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert cli.default_out_dir("speed") == REPO / "results" / "speed"
    monkeypatch.setenv(cli.RESULTS_ENV, str(tmp_path / "elsewhere"))
    assert cli.default_out_dir("noise") == tmp_path / "elsewhere" / "noise"


def test_noise_and_speed_write_to_the_default_out_dir_not_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cli.RESULTS_ENV, str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)
    assert speed.main(TINY + ["--n-prompts", "1", "--length", "2", "--layers", "1", "--bruteforce-positions", "1",
                              "--policy", "gradient"]) == 0
    assert noise.main(TINY + ["--n-prompts", "1", "--length", "2", "--exact-prompts", "0", "--draws", "1",
                              "--sigmas", "0", "--decoders", "nn-heuristic"]) == 0
    assert (tmp_path / "results" / "speed" / "speed.json").is_file()
    assert (tmp_path / "results" / "noise" / "noise.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_traceback_on_request(monkeypatch):
    monkeypatch.setenv("SIPIT_TRACEBACK", "1")
    with pytest.raises(ValueError, match="unknown model"):
        speed.main(["--model", "does-not-exist"])


def command(*argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "SIPIT_TRACEBACK")}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.perf_counter() - started


@pytest.mark.parametrize("argv, message", [
    (["benchmarks.experiments.noise", "--sigmas", "bogus"], "argument --sigmas: must be a finite number"),
    (["benchmarks.experiments.speed", "--model", "tiny-gpt2", "--layers", "99"], "--layers: layer 99 out of range"),
    (["benchmarks.run", "--model", "tiny-gpt2", "--defense", "tying", "--tie-groups", "100000", "--no-tracking"],
     "groups=100000 exceeds the vocabulary size 512"),
])
def test_command_line_exit_code_and_single_error_line(argv, message):
    proc, _ = command(*argv)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"python -m {argv[0]}: error: ") and message in last


def test_uncached_hub_id_fails_within_seconds(bad_models):
    proc, seconds = command("benchmarks.invert", "hello", "--model", "someorg/nonexistent-model")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'someorg/nonexistent-model' is not in the local HF cache" in proc.stderr.splitlines()[-1]
    assert seconds < 30  # imports included; the hub was never contacted (55 s of retries before)


def test_interrupt_once_keeps_later_signals_off_after_an_interruption():
    """A search worker gets the terminal's SIGINT and then its parent's: the second, arriving while the
    interpreter exits, once raised KeyboardInterrupt inside a weakref finalizer (a traceback in the log)."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in cli.INTERRUPT_SIGNALS}
    try:
        with cli.interrupt_once():
            pass
        assert {sig: signal.getsignal(sig) for sig in before} == before  # not interrupted: handlers restored
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            with cli.interrupt_once():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs here
        assert all(signal.getsignal(sig) is signal.SIG_IGN for sig in before)
        os.kill(os.getpid(), signal.SIGINT)  # a late Ctrl-C: ignored, no KeyboardInterrupt
        time.sleep(0.1)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_ctrl_c_that_lands_in_a_finaliser_is_delivered_after_it_and_nothing_is_printed(monkeypatch):
    """The search's flaky Ctrl-C test: SIGINT landed while the garbage collector ran a ``__del__`` in a
    worker, so KeyboardInterrupt was printed as "Exception ignored in ..." (a traceback) and swallowed."""
    import signal
    import sys

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    ran = []

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs here, inside the finaliser
            ran.append("finaliser done")

    before = {sig: signal.getsignal(sig) for sig in cli.INTERRUPT_SIGNALS}
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            with cli.interrupt_once():
                Finalised()  # dropped at once: __del__ runs now
                ran.append("after the finaliser")
                time.sleep(5)  # the redelivered signal interrupts this
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert ran == ["finaliser done", "after the finaliser"] and unraisable == []
