"""`python -m model convert-hf` / `convert` as a user runs them, on crafted inputs: every refusal is an
`error:` line (details, if any, on indented lines after it) and exit 1, never a traceback, and nothing is
written. Configs that lie about sizes are refused from the tensors' shapes before anything is built from
them (a hidden_size of 4 million once meant a 52 TB allocation, a million layers minutes of building)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.hf_helpers import TINY_BERT, tiny_bert_state_dict, write_tiny_bert
from tests.support.model_helpers import StockEncoder, tiny

ROOT = Path(__file__).resolve().parents[2]
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError


# `python -m model` once for every command of this file, each as a user runs it (its exit code, stdout and
# stderr; an exception that escapes `main` printed as the interpreter prints it, exit 1): one process
# importing torch once instead of seventeen (34 s of CPU before, on a 2-core machine).
RUNNER = """
import contextlib, io, json, sys, traceback
from model.__main__ import main
results = []
for argv in json.loads(open(sys.argv[1]).read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # as the interpreter ends on it: None is 0, a message is printed and 1
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append([code, out.getvalue(), err.getvalue()])
open(sys.argv[2], "w").write(json.dumps(results))
"""


def _cli_all(commands: dict[str, list[str]], directory: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command's outcome, by name, from one `python -m model`-like process."""
    (directory / "commands.json").write_text(json.dumps(list(commands.values())))
    # The timeout is a safety net, not a measurement: each command here takes a second or so.
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(directory / "commands.json"),
                           str(directory / "results.json")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((directory / "results.json").read_text())
    return {name: subprocess.CompletedProcess(["python", "-m", "model", *argv], code, out, err)
            for (name, argv), (code, out, err) in zip(commands.items(), results, strict=True)}


def _assert_refused(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines and lines[0].startswith("error: "), result.stderr[-3000:]
    assert all(line.startswith(" ") for line in lines[1:]), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr[-3000:]
    assert result.stdout == ""


def _edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


HF_CASES = [
    ("nested config.json", ["config.json is not readable JSON: nested too deeply"]),
    ("nested modules.json", ["modules.json is not readable JSON: nested too deeply"]),
    ("config.json with a 5000-digit int", ["config.json is not readable JSON", "4300 digits"]),
    ("hidden_size of 4 million", ["the config does not fit the weights (nothing was built from it)",
                                  "d_model=4000000, but the token embedding"]),
    ("a million layers", ["the config does not fit the weights", "n_layers=1000000, but the state_dict holds "
                          "2 layers through key map hf_bert (no 'encoder.layer.2.output.dense.weight')"]),
    ("intermediate_size of 10 million", ["d_ff=10000000, but the feed-forward output"]),
    ("max_position_embeddings of a billion", ["max_length=1000000000 and d_model=32, but the position table"]),
    ("an infinite weight", ["blocks.1.ff.fc1.weight <- copy(encoder.layer.1.intermediate.dense.weight): 1 of "
                            "2048 values are not finite"]),
]


def _hf_case(tmp_path: Path, case: str) -> list[str]:
    folder = write_tiny_bert(tmp_path / "hf")
    if case == "nested config.json":
        (folder / "config.json").write_text(DEEP)
    elif case == "nested modules.json":
        (folder / "modules.json").write_text(DEEP)
    elif case == "config.json with a 5000-digit int":
        (folder / "config.json").write_text('{"model_type": "bert", "hidden_size": ' + "9" * 5000 + "}")
    elif case == "hidden_size of 4 million":
        _edit_config(folder, hidden_size=4_000_000)
    elif case == "a million layers":
        _edit_config(folder, num_hidden_layers=1_000_000)
    elif case == "intermediate_size of 10 million":
        _edit_config(folder, intermediate_size=10_000_000)
    elif case == "max_position_embeddings of a billion":
        _edit_config(folder, max_position_embeddings=1_000_000_000)
    elif case == "an infinite weight":
        state = tiny_bert_state_dict(TINY_BERT)
        state["encoder.layer.1.intermediate.dense.weight"][5, 7] = float("inf")
        write_tiny_bert(folder, state_dict=state)
    return ["convert-hf", "--model-dir", str(folder), "--out", str(tmp_path / "out")]


def _stock_files(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    config = tiny(positional="none")
    torch.manual_seed(0)
    torch.save(StockEncoder(config).state_dict(), tmp_path / "state.pt")
    return tmp_path / "state.pt", config.to_dict()


def _stock_map_with(tok_emb_spec: str) -> str:
    text = (ROOT / "model" / "keymaps" / "stock.json").read_text()
    old = '"tok_emb.weight": "{embedding}weight"'
    assert old in text
    return text.replace(old, f'"tok_emb.weight": {tok_emb_spec}')


CONVERT_CASES = [
    ("nested config", ["EncoderConfig JSON is malformed: nested too deeply"]),
    ("nested key map", ["is malformed: nested too deeply"]),
    ("nested TOML key map", ["is malformed: nested too deeply"]),
    ("a spec nested 400 deep", ["specs nested deeper than 16 levels"]),
    ("d_model of a million", ["the config does not fit the weights", "d_model=1048576, but the token embedding"]),
    ("a million layers", ["n_layers=1000000, but the state_dict holds 2 layers through key map stock"]),
    ("max_length of a billion", ["max_length=1000000000 with d_model=32: no tensor states max_length"]),
    ("times 1e308", ["tok_emb.weight <- copy(embedding.weight) * 1e+308: 3200 of 3200 values are not finite"]),
]


def _convert_case(tmp_path: Path, case: str) -> list[str]:
    state, config = _stock_files(tmp_path)
    key_map = "stock"
    if case == "nested config":
        (tmp_path / "config.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    else:
        changes = {"d_model of a million": {"d_model": 2**20, "d_ff": 2**22, "vocab_size": 2**20},
                   "a million layers": {"n_layers": 10**6},
                   "max_length of a billion": {"max_length": 10**9, "positional": "sinusoidal"}}.get(case, {})
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    if case == "nested key map":
        (tmp_path / "map.json").write_text(DEEP)
        key_map = str(tmp_path / "map.json")
    elif case == "nested TOML key map":
        (tmp_path / "map.toml").write_text("a = " + DEEP)
        key_map = str(tmp_path / "map.toml")
    elif case == "a spec nested 400 deep":
        (tmp_path / "map.json").write_text(_stock_map_with('{"op": "copy", "src": ' * 400 + '"{embedding}weight"'
                                                           + "}" * 400))
        key_map = str(tmp_path / "map.json")
    elif case == "times 1e308":
        (tmp_path / "map.json").write_text(_stock_map_with('{"op": "copy", "src": "{embedding}weight", '
                                                           '"times": 1e308}'))
        key_map = str(tmp_path / "map.json")
    return ["convert", "--state-dict", str(state), "--config", str(tmp_path / "config.json"),
            "--out", str(tmp_path / "out"), "--name", "x", "--version", "1", "--key-map", key_map]


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess[str]]]:
    """(the folder, each command's outcome by name): every case's inputs crafted in a folder of its own,
    then all the commands run at once (`_cli_all`)."""
    root = tmp_path_factory.mktemp("refusals")
    commands: dict[str, list[str]] = {}
    for kind, cases, craft in (("hf", HF_CASES, _hf_case), ("convert", CONVERT_CASES, _convert_case)):
        for number, (case, _) in enumerate(cases):
            (root / kind / str(number)).mkdir(parents=True)
            commands[f"{kind}: {case}"] = craft(root / kind / str(number), case)
    folder = write_tiny_bert(root / "out" / "hf")
    busy, empty = root / "out" / "busy", root / "out" / "empty"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    (root / "out" / "file").write_text("x")
    empty.mkdir()
    commands["busy"] = ["convert-hf", "--model-dir", str(folder), "--out", str(busy)]
    commands["file"] = ["default", "--out", str(root / "out" / "file")]
    commands["empty"] = ["convert-hf", "--model-dir", str(folder), "--out", str(empty)]
    return root, _cli_all(commands, root)


@pytest.mark.parametrize(("number", "case", "fragments"), [(n, *c) for n, c in enumerate(HF_CASES)],
                         ids=[c[0] for c in HF_CASES])
def test_convert_hf_refuses_crafted_folders(ran: tuple[Path, dict[str, subprocess.CompletedProcess[str]]],
                                            number: int, case: str, fragments: list[str]) -> None:
    root, results = ran
    _assert_refused(results[f"hf: {case}"], *fragments)
    assert not (root / "hf" / str(number) / "out").exists()


@pytest.mark.parametrize(("number", "case", "fragments"), [(n, *c) for n, c in enumerate(CONVERT_CASES)],
                         ids=[c[0] for c in CONVERT_CASES])
def test_convert_refuses_crafted_inputs(ran: tuple[Path, dict[str, subprocess.CompletedProcess[str]]],
                                        number: int, case: str, fragments: list[str]) -> None:
    root, results = ran
    _assert_refused(results[f"convert: {case}"], *fragments)
    assert not (root / "convert" / str(number) / "out").exists()


def test_out_must_be_new_or_empty(ran: tuple[Path, dict[str, subprocess.CompletedProcess[str]]]) -> None:
    root, results = ran
    busy, empty = root / "out" / "busy", root / "out" / "empty"
    _assert_refused(results["busy"], f"--out {busy} is not empty (it holds notes.txt)")
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and (busy / "notes.txt").read_text() == "mine"
    _assert_refused(results["file"], "is a file")
    assert results["empty"].returncode == 0, results["empty"].stderr
    assert sorted(p.name for p in empty.iterdir()) == ["manifest.json", "model.pt", "tokenizer.json"]


@pytest.mark.parametrize(("case", "outputs", "fragments"), [
    ("id2label of 4, a head of 3", 3, ["classifier.weight has 3 output(s)", "(id2label has 4 entries)"]),
    ("id2label of 2, a head of 3", 3, ["classifier.weight has 3 output(s)", "(id2label has 2 entries)"]),
    ("no id2label, a head of 1", 1, ["classifier.weight has 1 output(s)", "transformers' default of 2 labels"]),
    ("num_labels 5, a head of 3", 3, ["classifier.weight has 3 output(s)", "(num_labels=5)"]),
    ("xlm-r: id2label of 2, a head of 1", 1, ["classifier.out_proj.weight has 1 output(s)",
                                              "(id2label has 2 entries)"]),
])
def test_a_classifier_whose_labels_disagree_with_its_head_is_refused_as_transformers_refuses_it(
        tmp_path: Path, case: str, outputs: int, fragments: list[str]) -> None:
    import transformers

    from tests.support.head_helpers import write_bert_classifier, write_xlmr_reranker

    if case.startswith("xlm-r"):
        folder, _ = write_xlmr_reranker(tmp_path / "hf")
    else:
        folder, _ = write_bert_classifier(tmp_path / "hf", num_labels=outputs)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)  # as written: it loads
    assert model.config.num_labels == outputs
    config = json.loads((folder / "config.json").read_text())
    config.pop("label2id", None)
    if case.startswith("no id2label"):
        config.pop("id2label")
    elif case.startswith("num_labels"):
        config["num_labels"] = 5
    else:
        config["id2label"] = {str(i): f"L{i}" for i in range(4 if "of 4" in case else 2)}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers refuses the folder
        transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    _assert_refused(_cli_all({"c": ["convert-hf", "--model-dir", str(folder), "--out", str(tmp_path / "out")]},
                             tmp_path)["c"],
                    "config.json declares", "transformers refuses this folder too", *fragments)
    assert not (tmp_path / "out").exists()
