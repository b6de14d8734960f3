"""`msmodelslim analyze` and `msmodelslim tune` end to end with the real service: the tiny Kimi-K3 for analyze
(rankings, files, refusals), kimi-linear-mini for tune (a trained model: perplexity deltas mean something).
References: the report file the run wrote (exact strings and its own ranking), a planted outlier (one column of an
o_proj times 30: exactly one linear must rank first), perplexity deltas against the target the test sets."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml
from reliability.faults import planted_outlier

from msmodelslim.cli.main import main
from msmodelslim.core.report import ranked

pytestmark = pytest.mark.slow  # whole quantization runs

REPO = Path(__file__).resolve().parents[2]
MINI = REPO.parent / "shared" / "models" / "kimi-linear-mini"
TEXT = REPO.parent / "shared" / "data" / "text" / "python_tutorial.txt"
OUTLIER = "language_model.model.layers.2.self_attn.o_proj"


def minmax_everywhere(source: str, dest: Path, **spec) -> Path:
    """The shipped practice `source` cut to one min/max W4A8_DYNAMIC entry over every linear it quantizes (no
    rotation, no smoothing: what a planted outlier should stand out of), per group of 32 inputs (vllm-ascend serves
    W4A8 outside the routed experts per group only, and releases/v0.26.0rc alone: `target: vllm-ascend-0.26`)."""
    practice = yaml.safe_load((REPO / "lab_practice" / "kimi_k3" / source).read_text())
    quantizers = [s for s in practice["spec"]["process"] if s["type"] == "linear_quant"]
    include = [g for q in quantizers for g in q["include"]]
    step = {"type": "linear_quant", "include": include,
            "exclude": sorted({g for q in quantizers for g in q.get("exclude", [])} - set(include)),
            "qconfig": {"act": {"scope": "per_token", "dtype": "int8"},
                        "weight": {"scope": "per_group", "ext": {"group_size": 32}, "dtype": "int4",
                                   "method": "minmax"}}}
    practice["spec"].update(process=[step], target="vllm-ascend-0.26", **spec)
    dest.write_text(yaml.safe_dump(practice))
    return dest


def analyze_argv(model: Path, practice: Path, *extra: str) -> list[str]:
    return ["analyze", "--model_path", str(model), "--device", "cpu", "--model_type", "Kimi-K3", "--config_path",
            str(practice), "--trust_remote_code", "True", "--log_level", "warning", *extra]


@pytest.fixture(scope="module")
def planted(tiny_k3_checkpoint, tmp_path_factory) -> Path:
    """The tiny Kimi-K3 with one input column of OUTLIER times 30 (other files linked)."""
    return planted_outlier(tiny_k3_checkpoint, tmp_path_factory.mktemp("planted") / "ckpt", OUTLIER, 3)


def test_analyze_ranks_a_planted_outlier_first_and_writes_only_the_files_asked_for(planted, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "tmp" / "p.yaml", max_samples=4, max_seq_len=64)
    names, report = tmp_path / "disable.yaml", tmp_path / "report.json"
    code = main(analyze_argv(planted, practice, "--top_k", "3", "--save_path", str(names), "--report_path",
                             str(report)))
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("msmodelslim analyze: the 3 of ") and f"    1  {OUTLIER} " in out
    listed = yaml.safe_load(names.read_text())
    written = json.loads(report.read_text())
    assert listed["metric"] == "error" and listed["disable_names"][0] == OUTLIER
    assert listed["disable_names"] == [n for n, _ in ranked(written["linears"])][:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disable.yaml", "report.json", "tmp"]
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("msmodelslim")]  # its run is gone


def test_a_quant_run_of_the_planted_checkpoint_ranks_the_outlier_first_and_a_fallback_takes_it(planted, tmp_path,
                                                                                               capsys):
    save = tmp_path / "out"
    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "plain.yaml", max_samples=4, max_seq_len=64)
    assert main(["quant", "--model_path", str(planted), "--save_path", str(save), "--device", "cpu", "--model_type",
                 "Kimi-K3", "--config_path", str(practice), "--trust_remote_code", "True"]) == 0
    report = json.loads((save / "quant_report.json").read_text())
    assert ranked(report["linears"])[0][0] == OUTLIER
    assert report["linears"][OUTLIER]["weight_kurtosis"] > 30
    practice = yaml.safe_load((save / "Kimi-K3_best_practice.yaml").read_text())
    practice["spec"]["fallback"] = [{"to": "FLOAT", "report": str(save / "quant_report.json"), "top_k": 1}]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(practice))
    again = tmp_path / "again"
    assert main(["quant", "--model_path", str(planted), "--save_path", str(again), "--device", "cpu",
                 "--model_type", "Kimi-K3", "--config_path", str(tmp_path / "p.yaml"), "--trust_remote_code",
                 "True"]) == 0
    description = json.loads((again / "quant_model_description.json").read_text())
    assert description[f"{OUTLIER}.weight"] == "FLOAT"
    assert OUTLIER not in json.loads((again / "quant_report.json").read_text())["linears"]


def small_image_set(folder: Path) -> Path:
    """Two records of lab_calib/calibImages (an image one and a text one) in `folder`."""
    source = REPO / "lab_calib" / "calibImages"
    (folder / "images").mkdir(parents=True)
    (folder / "images" / "bar_chart.png").write_bytes((source / "images" / "bar_chart.png").read_bytes())
    (folder / "index.jsonl").write_text(json.dumps({"image": "images/bar_chart.png", "text": "What is shown?"}) + "\n"
                                        + json.dumps({"text": "A line of plain text to calibrate on."}) + "\n")
    return folder


def test_analyze_without_a_quant_type_ranks_float_statistics_over_the_default_practices_linears(planted, tmp_path,
                                                                                                capsys):
    """No --quant_type / --config_path (upstream's analyze): a weight statistic needs no scheme. Reference: the
    planted column (x30) gives OUTLIER the largest weight kurtosis; the summary names the W8A8 practice whose linear
    selection was ranked."""
    code = main(["analyze", "--model_path", str(planted), "--device", "cpu", "--model_type", "Kimi-K3",
                 "--trust_remote_code", "True", "--log_level", "warning", "--metrics", "weight_kurtosis", "--top_k",
                 "2", "--calibration_dataset", str(small_image_set(tmp_path / "calib"))])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "weight_kurtosis (no --quant_type: float statistics over the linears kimi_k3_w8a8.yaml quantizes)" \
        in out.splitlines()[0]
    assert f"    1  {OUTLIER} " in out and "W8A8_DYNAMIC" in out


@pytest.mark.parametrize("extra,message", [
    (("--metrics", "entropy"), "--metrics 'entropy': expected one of mse, kurtosis"),
    (("--top_k", "0"), "--top_k 0: must be a positive integer"),
    (("--patterns", "*no_such_proj*"), "--patterns '*no_such_proj*' matches none of the"),
    (("--save_path", "names.txt"), "--save_path names.txt: expected a .yaml or .yml file"),
])
def test_bad_analyze_input_is_one_line_and_writes_nothing(tiny_k3_checkpoint, tmp_path, capsys, monkeypatch,
                                                          extra, message):
    monkeypatch.chdir(tmp_path)
    code = main(analyze_argv(tiny_k3_checkpoint, REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml", *extra))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("msmodelslim: error: ") and message in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not (MINI / "config.json").is_file() or not TEXT.is_file(), reason="../shared not available")
def test_tune_falls_back_until_the_kl_target_holds_and_publishes_that_round(tmp_path, capsys):
    """kimi-linear-mini, min/max W4A8_DYNAMIC per group of 32 on every linear of the shipped practice and nothing
    else (no rotation, no smoothing), ranked by `error` (the impact's probe would cost this test a third of its time
    for a ranking --step 100 does not use; the impact round practice: the next test). --step 100 moves every quantized linear one step per round: W8A8 in round 1, FLOAT in round 2, whose output is
    the float model (KL 0: reference, the original's own next-token distribution), so a 1e-6 KL target holds there
    and nowhere before, on any CPU's float kernels."""
    minmax_everywhere("kimi_linear_w4a8.yaml", tmp_path / "p.yaml", max_samples=2, max_seq_len=64)
    save = tmp_path / "tuned"
    code = main(["tune", "--model_path", str(MINI), "--save_path", str(save), "--device", "cpu", "--model_type",
                 "Kimi-Linear", "--config_path", str(tmp_path / "p.yaml"), "--dataset", str(TEXT),
                 "--target_kl", "1e-6", "--metric", "error", "--step", "100", "--max_rounds", "4", "--seq_len", "128",
                 "--max_windows", "2", "--log_level", "warning"])
    out = capsys.readouterr().out
    assert code == 0 and "target reached (KL 1e-06) in 3 round(s)" in out, out
    rounds = [line for line in out.splitlines() if line.strip().startswith("round ")]
    kls = [float(line.split(", KL ")[1].split()[0]) for line in rounds]
    assert kls[0] > kls[1] > 1e-6 >= kls[2] and rounds[2].endswith("<- published"), out
    description = json.loads((save / "quant_model_description.json").read_text())
    assert {v for k, v in description.items() if k.endswith(".weight")} == {"FLOAT"}
    kept = yaml.safe_load((save / "Kimi-Linear_best_practice.yaml").read_text())
    assert [e["to"] for e in kept["spec"]["fallback"]] == ["FLOAT"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml", "tuned"]  # the rounds are gone


@pytest.mark.parametrize("flags, said", [
    ([], "one of the arguments --target_ppl_delta --target_kl is required"),
    (["--target_ppl_delta", "1", "--target_kl", "0.1"], "not allowed with argument"),
    (["--target_kl", "0"], "--target_kl 0.0: must be a positive number of nats per token"),
    (["--target_kl", "0.1", "--metric", "loss"], "--metric 'loss': expected one of"),
])
def test_tune_takes_exactly_one_positive_target_and_a_report_metric(flags, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        code = main(["tune", "--model_path", str(MINI), "--save_path", str(tmp_path / "t"), "--device", "cpu",
                     "--model_type", "Kimi-Linear", "--quant_type", "w4a8", "--dataset", str(TEXT), *flags])
        raise SystemExit(code)
    assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def k3_sized_groups() -> list[tuple[str, list[str]]]:
    """Kimi-K3's fused serving layers by name: 93 layers of 896 routed experts (w1/w2/w3), shared experts and a KDA
    attention's packed q/k/v/g/f_a/b (~251k linears)."""
    fused = []
    for layer in range(93):
        prefix = f"language_model.model.layers.{layer}"
        fused.append((f"{prefix}.block_sparse_moe.experts",
                      [f"{prefix}.block_sparse_moe.experts.{e}.{w}" for e in range(896) for w in ("w1", "w2", "w3")]))
        fused.append((f"{prefix}.block_sparse_moe.shared_experts.gate_up_proj",
                      [f"{prefix}.block_sparse_moe.shared_experts.{p}" for p in ("gate_proj", "up_proj")]))
        fused.append((f"{prefix}.self_attn.in_proj_qkvgfab",
                      [f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj",
                                                           "b_proj")]))
    return fused


def test_a_tune_round_practice_stays_small_at_kimi_k3_scale_and_names_exactly_the_fallen_back_linears():
    """Round 2 of a tune with --step 10 on a model of Kimi-K3's size: every other layer's experts and attention
    moved (~125k linears). Spelled out, that practice passes the 1 MiB practice limit; the written one is read back by
    the practice loader (core/config.py) and its globs select exactly the fallen-back linears of the model
    (reference: the fallback dict, over every linear name). Ranked by `impact` (tune's default), the round's report
    measures it: the practice sets spec.report_impact_tokens to DEFAULT_IMPACT_TOKENS."""
    from msmodelslim.app.tune import _practice_with
    from msmodelslim.core.config import DEFAULT_IMPACT_TOKENS, load_practice
    from msmodelslim.core.files import MAX_SMALL_FILE_BYTES
    from msmodelslim.processor.catalog import registries
    from msmodelslim.processor.globs import any_match

    fused = k3_sized_groups()
    every = sorted({name for _, shards in fused for name in shards})
    fallback = {name: "W8A8_DYNAMIC" if ".experts." in name else "FLOAT" for group, shards in fused[::2]
                for name in shards}
    base = yaml.safe_load((REPO / "lab_practice" / "kimi_k3" / "kimi_k3_w4a8.yaml").read_text())
    text = yaml.safe_dump(_practice_with(base, REPO, fallback, fused, "impact"), sort_keys=False)
    assert len(text) < MAX_SMALL_FILE_BYTES // 16, len(text)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "round2.yaml").write_text(text)
        spec = load_practice(Path(tmp) / "round2.yaml", *registries()).spec
    assert spec.report_impact_tokens == DEFAULT_IMPACT_TOKENS
    entries = spec.fallback
    for entry in entries:
        chosen = {name for name in every if any_match(name, entry.globs)}
        assert chosen == {n for n, s in fallback.items() if s == entry.to}, entry.to


def eval_text(folder: Path) -> Path:
    """A text of a few hundred tokens (two windows of 64) that needs nothing from ../shared."""
    path = folder / "eval.txt"
    path.write_text("The quick brown fox jumps over the lazy dog while the calibration set waits. " * 40)
    return path


def tune_argv(model: Path, save: Path, practice: Path, dataset: Path, *extra: str) -> list[str]:
    return ["tune", "--model_path", str(model), "--save_path", str(save), "--device", "cpu", "--model_type",
            "Kimi-K3", "--config_path", str(practice), "--trust_remote_code", "True", "--dataset", str(dataset),
            "--target_ppl_delta", "1", "--seq_len", "64", "--max_windows", "2", *extra]


def test_tune_checks_its_evaluation_text_before_round_0(tiny_k3_checkpoint, tmp_path, capsys, monkeypatch):
    """A text too short for one window is one error line before any quantization (a round 0 would take hours on
    Kimi-K3): reference, `quant` is never called."""
    from msmodelslim.app import tune as tune_mod

    monkeypatch.setattr(tune_mod, "quant", lambda *a, **k: pytest.fail("round 0 ran"))
    (tmp_path / "short.txt").write_text("Too short for a window of 64 tokens.")
    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "p.yaml", max_samples=2, max_seq_len=32)
    code = main(tune_argv(tiny_k3_checkpoint, tmp_path / "out", practice, tmp_path / "short.txt"))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("msmodelslim: error: ")]
    assert code == 2 and len(errors) == 1 and "short.txt: fewer than seq_len=64 tokens" in errors[0], errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml", "short.txt"]


def test_tune_refuses_an_output_another_run_holds(tiny_k3_checkpoint, tmp_path, capsys):
    import fcntl
    import os

    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "p.yaml", max_samples=2, max_seq_len=32)
    fd = os.open(tmp_path / ".out.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        code = main(tune_argv(tiny_k3_checkpoint, tmp_path / "out", practice, eval_text(tmp_path)))
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert code == 2 and "another msmodelslim run (pid 4242) is writing it" in err, err


def test_an_interrupted_tune_offers_no_resume_and_leaves_nothing(tiny_k3_checkpoint, tmp_path, capsys, caplog,
                                                                  monkeypatch):
    """Ctrl-C once round 0 has finished every unit (its quant run would keep resumable state): tune has no
    --resume, so nothing says to use one, and its rounds are gone."""
    from msmodelslim.processor.save.ascendv1_saver import AscendV1Saver

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(AscendV1Saver, "finish_rank", interrupted)
    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "p.yaml", max_samples=2, max_seq_len=32)
    code = main(tune_argv(tiny_k3_checkpoint, tmp_path / "out", practice, eval_text(tmp_path)))
    assert code == 130
    assert "--resume" not in capsys.readouterr().err + caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.txt", "p.yaml"]


def test_analyze_never_overwrites_a_file_that_appeared_during_its_run(tiny_k3_checkpoint, tmp_path, capsys,
                                                                      monkeypatch):
    """--save_path did not exist when analyze checked it; another process writes it while the run computes. That
    file stays as it was, the analysis's names are kept beside it, and the error line says where."""
    from msmodelslim.app import analyze as analyze_mod

    names = tmp_path / "disable.yaml"
    real = analyze_mod.run_quant_service

    def another_process_writes_it(*args, **kwargs):
        real(*args, **kwargs)
        names.write_text("theirs\n")

    monkeypatch.setattr(analyze_mod, "run_quant_service", another_process_writes_it)
    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "p.yaml", max_samples=2, max_seq_len=32)
    code = main(analyze_argv(tiny_k3_checkpoint, practice, "--save_path", str(names)))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("msmodelslim: error: ")]
    assert code == 2 and len(errors) == 1 and "another process wrote it during the analysis" in errors[0], err
    assert names.read_text() == "theirs\n"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("disable.msmodelslim-")]
    assert len(kept) == 1 and "disable_names:" in kept[0].read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["p.yaml", "disable.yaml", kept[0].name])
