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
from safetensors.torch import load_file, save_file

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
    W4A8 outside the routed experts per group only)."""
    practice = yaml.safe_load((REPO / "lab_practice" / "kimi_k3" / source).read_text())
    quantizers = [s for s in practice["spec"]["process"] if s["type"] == "linear_quant"]
    include = [g for q in quantizers for g in q["include"]]
    step = {"type": "linear_quant", "include": include,
            "exclude": sorted({g for q in quantizers for g in q.get("exclude", [])} - set(include)),
            "qconfig": {"act": {"scope": "per_token", "dtype": "int8"},
                        "weight": {"scope": "per_group", "ext": {"group_size": 32}, "dtype": "int4",
                                   "method": "minmax"}}}
    practice["spec"].update(process=[step], **spec)
    dest.write_text(yaml.safe_dump(practice))
    return dest


def analyze_argv(model: Path, practice: Path, *extra: str) -> list[str]:
    return ["analyze", "--model_path", str(model), "--device", "cpu", "--model_type", "Kimi-K3", "--config_path",
            str(practice), "--trust_remote_code", "True", "--log_level", "warning", *extra]


@pytest.fixture(scope="module")
def planted(tiny_k3_checkpoint, tmp_path_factory) -> Path:
    """The tiny Kimi-K3 with one input column of OUTLIER times 30 (other files linked)."""
    out = tmp_path_factory.mktemp("planted") / "ckpt"
    out.mkdir()
    index = json.loads((tiny_k3_checkpoint / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][f"{OUTLIER}.weight"]
    for f in tiny_k3_checkpoint.iterdir():
        if f.name != shard:
            (out / f.name).symlink_to(f)
    tensors = load_file(str(tiny_k3_checkpoint / shard))
    tensors[f"{OUTLIER}.weight"][:, 3] *= 30
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    return out


def test_analyze_ranks_a_planted_outlier_first_and_writes_only_the_files_asked_for(planted, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "tmp" / "p.yaml")
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
    practice = minmax_everywhere("kimi_k3_w4a8.yaml", tmp_path / "plain.yaml")
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


@pytest.mark.skipif(not (MINI / "config.json").is_file(), reason=f"{MINI} not available")
def test_tune_falls_back_until_the_target_holds_and_publishes_that_round(tmp_path, capsys):
    """kimi-linear-mini, min/max W4A8_DYNAMIC per group of 32 on every linear of the shipped practice (round 0
    about +0.5 % on these windows); --step 100 moves every quantized linear to W8A8 in round 1, which meets a 0.3 %
    target."""
    minmax_everywhere("kimi_linear_w4a8.yaml", tmp_path / "p.yaml", max_samples=4, max_seq_len=128)
    save = tmp_path / "tuned"
    code = main(["tune", "--model_path", str(MINI), "--save_path", str(save), "--device", "cpu", "--model_type",
                 "Kimi-Linear", "--config_path", str(tmp_path / "p.yaml"), "--dataset", str(TEXT),
                 "--target_ppl_delta", "0.3", "--step", "100", "--max_rounds", "3", "--seq_len", "256",
                 "--max_windows", "4", "--log_level", "warning"])
    out = capsys.readouterr().out
    assert code == 0 and "target reached (0.3 %) in 2 round(s)" in out, out
    assert "round 1:" in out and "<- published" in out.splitlines()[2]
    description = json.loads((save / "quant_model_description.json").read_text())
    assert "W4A8_DYNAMIC" not in description.values() and "W8A8_DYNAMIC" in description.values()
    kept = yaml.safe_load((save / "Kimi-Linear_best_practice.yaml").read_text())
    assert [e["to"] for e in kept["spec"]["fallback"]] == ["W8A8_DYNAMIC"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml", "tuned"]  # the rounds are gone
