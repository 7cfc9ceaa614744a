"""Tasks and columns without Ray: what a job may ask of its data is checked against the
schema before anything starts, one line each, nothing written; rows are read as the task
needs them."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from baton.data.feed import DataError, read_unit
from baton.data.manifest import Manifest
from baton.data.rows import _arrays
from baton.data.source import preflight
from baton.errors import SpecError
from baton.spec import spec_from_dict
from baton.tasks import VALID, Classification, LanguageModel, padded
from conftest import REPO
from helpers import write_table

CLASSIFY = {"inputs": ["vec", "a", "b"], "label": "label"}


def _spec(tmp_path, path, **over) -> dict:
    raw = {"name": "t", "task": "classification",
           "model": {"name": "classifier", "layers": 1, "width": 8,
                     "options": {"inputs": 6, "classes": 4}},
           "data": {"source": "parquet", "path": str(path), "columns": CLASSIFY},
           "checkpoint": {"path": str(tmp_path / "ckpt")}, "tracking": {"enabled": False}}
    for key, value in over.items():
        section, _, field = key.partition(".")
        if field:
            raw.setdefault(section, {})[field] = value
        else:
            raw[section] = value
    return raw


def _refused(tmp_path, path, **over) -> str:
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SpecError) as e:
        preflight(spec_from_dict(_spec(tmp_path, path, **over), "job.yaml"), "job.yaml")
    message = str(e.value)
    assert "\n" not in message and message.startswith("job.yaml: ")
    assert sorted(os.listdir(tmp_path)) == before  # nothing written
    return message


def test_columns_are_read_as_the_task_needs_them(tmp_path):
    data = write_table(tmp_path / "data")
    got = preflight(spec_from_dict(_spec(tmp_path, data)), "job.yaml")
    fields = {f.name: (f.sources, f.shape, f.dtype) for f in got.columns.fields}
    assert fields == {"inputs": (("vec", "a", "b"), (6,), "float32"),
                      "label": (("label",), (), "int64")}
    manifest = Manifest.build(str(data))
    table = read_unit(str(data), manifest.units[1], got.columns)
    ids, columns = _arrays([table], got.columns.shapes())
    raw = pq.read_table(data).slice(8, 8)
    want = np.concatenate([raw.column("vec").combine_chunks().flatten().to_numpy().reshape(8, 4),
                           raw.column("a").to_numpy()[:, None], raw.column("b").to_numpy()[:, None]], 1)
    np.testing.assert_array_equal(columns["inputs"], want.astype(np.float32))
    np.testing.assert_array_equal(columns["label"], raw.column("label").to_numpy())
    np.testing.assert_array_equal(ids, raw.column("sample_id").to_numpy())


@pytest.mark.parametrize("over, expected", [
    ({"data.columns": {"inputs": ["vec", "aa"], "label": "label"}},
     "data.columns.inputs: 'aa' is not a column of"),  # and "did you mean 'a'?"
    ({"data.columns": {"inputs": ["vec", "name"], "label": "label"}},
     "data.columns.inputs: 'name' holds string; the task reads numbers"),
    ({"data.columns": {"inputs": ["vec"], "label": "y"}},
     "data.columns.label: classification needs one integer class per row"),
    ({"data.columns": {"inputs": ["vec", "a"], "label": "label"}},
     "model.options.inputs: 6 does not fit the data; data.columns.inputs gives 5 values a row"),
    ({"task": "helpers:no_loss_task", "data.columns": {"inputs": ["vec", "a", "b"]}},
     "must return a dict with a tensor 'loss'"),
    ({"task": "helpers:three_part_ratio_task", "data.columns": {"inputs": ["vec", "a", "b"]}},
     "a metric may be a pair of them, numerator and denominator, a pair of vectors of one "
     "length, each class's, or baton.tasks.auroc or average_precision); f1 is not"),
    ({"model": {"name": "gpt", "layers": 1, "width": 8, "heads": 2}},
     "the model's output on the data's inputs [6] failed"),
    ({"eval": {"fraction": 0.99}}, "eval.fraction: 0.99 holds out 12 of the 12 row groups"),
])
def test_a_job_its_data_cannot_serve_is_refused_in_one_line(tmp_path, over, expected):
    data = write_table(tmp_path / "data")
    message = _refused(tmp_path, data, **over)
    assert expected in message, message
    if "'aa'" in expected:
        assert "did you mean 'a'?" in message


def test_eval_data_that_is_training_data_is_refused(tmp_path):
    data = write_table(tmp_path / "data")
    message = _refused(tmp_path, data, eval={"path": str(data)})
    assert "eval.path" in message and "shares 1 file(s) with data.path" in message


@pytest.mark.parametrize("raw, expected", [
    ({"task": "classification", "data": {"source": "stdlib"}}, "data.source: 'stdlib' is invalid"),
    ({"task": "classification", "data": {"source": "parquet", "columns": {"inputs": "x"}}},
     "task classification reads label"),
    ({"data": {"source": "parquet", "columns": {"inputs": "x"}}},
     "a language model reads data.token_column"),
    ({"task": "nope"}, "task: 'nope' is invalid; use one of language_model, classification"),
    ({"task": "helpers:absent"}, "module 'helpers' has no 'absent'"),
    ({"task": "classification", "model": {"name": "classifier"},
      "data": {"source": "parquet", "columns": {"inputs": "x", "label": "y"}}},
     "classifier needs model.options inputs and classes"),
    ({"eval": {"fraction": 0.1, "path": "x"}}, "not both"),
    ({"data": {"source": "parquet", "columns": {"valid": "x"}}, "task": "helpers:regression"},
     "data.columns.valid"),
    # checkpoint.best: a metric the evaluation reports, which way is better, every checkpoint
    # evaluated
    ({"checkpoint": {"best": "eval_accuracy", "best_mode": "max"}, "eval": {"fraction": 0.1}},
     "checkpoint.best: 'eval_accuracy' is invalid; names a metric of the held-out evaluation: eval_loss"),
    ({"checkpoint": {"best": "loss"}, "eval": {"fraction": 0.1}, "task": "helpers:regression",
      "data": {"source": "parquet", "columns": {"inputs": "x", "target": "y"}}},
     "names a metric of the held-out evaluation: eval_loss or eval_ and your task's metric"),
    ({"checkpoint": {"best_mode": "min"}}, "checkpoint.best_mode: 'min' is invalid; says which way"),
    ({"checkpoint": {"best": "eval_accuracy"}, "eval": {"fraction": 0.1}, "task": "classification",
      "data": {"source": "parquet", "columns": {"inputs": "x", "label": "y"}}},
     "checkpoint.best_mode: None is invalid; say min or max: which way eval_accuracy is better"),
    ({"checkpoint": {"best": "eval_loss"}}, "set eval.fraction or eval.path"),
    ({"checkpoint": {"best": "eval_loss", "every_steps": 50}, "eval": {"fraction": 0.1, "every_steps": 20}},
     "eval.every_steps: 20 is invalid; must divide checkpoint.every_steps (50) so that every "
     "checkpoint is evaluated for checkpoint.best (e.g. 50)"),
    # eval.patience: watches checkpoint.best's metric
    ({"eval": {"fraction": 0.1, "every_steps": 10, "patience": 3}},
     "eval.patience: 3 is invalid; stops the run when checkpoint.best's metric stops improving: "
     "name it (e.g. checkpoint.best: eval_loss)"),
    ({"eval": {"fraction": 0.1, "min_delta": 0.01}}, "eval.min_delta: 0.01 is invalid; counts only "
                                                     "with eval.patience"),
    ({"eval": {"fraction": 0.1, "patience": -1}}, "eval.patience: -1 is invalid; must be >= 0"),
    ({"eval": {"fraction": 0.1, "every_steps": 10, "patience": 2, "min_delta": -0.5},
      "checkpoint": {"best": "eval_loss", "every_steps": 10}},
     "eval.min_delta: -0.5 is invalid; must be >= 0"),
    ({"eval": {"fraction": 0.1, "patience": 10**7}}, "eval.patience: 10000000 is invalid; at most"),
])
def test_spec_mistakes_about_tasks_are_one_line(raw, expected):
    with pytest.raises(SpecError) as e:
        spec_from_dict({"name": "t", **raw}, "job.yaml")
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_labels_outside_the_classes_are_refused_naming_the_file(tmp_path):
    """From the footer's statistics, before anything starts; a file written without them is
    refused when its row group is read (the first before Ray starts, naming the row group)."""
    data = write_table(tmp_path / "data")
    two = {"name": "classifier", "layers": 1, "width": 8, "options": {"inputs": 6, "classes": 2}}
    message = _refused(tmp_path, data, model=two)
    assert message == (f"job.yaml: data.columns.label: values in {data}/table.parquet lie in "
                       "[0, 3] but the model has 2 classes (model.options.classes); labels must "
                       "lie in [0, 2)")
    pq.write_table(pq.read_table(data / "table.parquet"), data / "table.parquet",
                   row_group_size=8, write_statistics=False)
    with pytest.raises(DataError, match=r"row group 0: data.columns.label values lie in \[0, 3\] "
                                        r"but the model has 2 classes"):
        preflight(spec_from_dict(_spec(tmp_path, data, model=two)), "job.yaml")


def _second_file(data, change) -> None:
    """A second file beside `data`'s table.parquet: its rows changed by `change(table)`."""
    table = pq.read_table(data / "table.parquet")
    pq.write_table(change(table), data / "table2.parquet", row_group_size=8)


def _set(table: pa.Table, name: str, values) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, values)


def _with_null(table: pa.Table, name: str, row: int) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = None
    return _set(table, name, pa.array(values, table.schema.field(name).type))


@pytest.mark.parametrize("change, expected", [
    (lambda t: t.drop_columns(["label"]),
     "data.columns.label: 'label' is not a column of {data}/table2.parquet (columns: sample_id, "
     "vec, a, b, y, name); every file must hold the columns data.columns reads"),
    (lambda t: _set(t, "label", t.column("label").cast(pa.float32())),
     "data.columns.label: 'label' holds float in {data}/table2.parquet, where the first file "
     "holds int64; every file must hold it as the same kind of values"),
    (lambda t: _set(t, "vec", pa.array(t.column("vec").to_pylist(), pa.list_(pa.float32()))),
     "data.columns.inputs: 'vec' holds list<element: float> in {data}/table2.parquet, where the "
     "first file holds fixed_size_list<element: float>[4]; every file must hold it as the same kind"),
    (lambda t: _with_null(t, "label", 21),
     "data.columns.label: 'label' has 1 null value in {data}/table2.parquet (the first in row "
     "group 2); drop or fill them, and write the file again"),
    (lambda t: _with_null(t, "vec", 9),
     "data.columns.inputs: 'vec' has 1 null value in {data}/table2.parquet (the first in row "
     "group 1)"),
    (lambda t: t.drop_columns(["sample_id"]),
     "data.id_column: 'sample_id' is not a column of {data}/table2.parquet (columns: vec, a, b, "
     "label, y, name); every file must hold it"),
])
def test_a_file_unlike_the_first_is_refused_from_its_footer_naming_it(tmp_path, change, expected):
    """Every file's footer is read for the manifest: a column missing from a later file, of
    another kind there, or holding a null is refused in one line naming the file (and the row
    group) before anything starts, not when its row group is read, possibly hours in (each
    used to end the run there: a KeyError through Ray Data's traceback, or `the file is
    damaged` for a null list)."""
    data = write_table(tmp_path / "data")
    _second_file(data, change)
    assert expected.format(data=data) in _refused(tmp_path, data)


def test_token_rows_of_another_length_or_ids_past_the_vocabulary_are_refused_from_the_footers(tmp_path):
    """A language model's corpus: a later file whose rows (lists of any length) hold one token
    more in one row group, or ids the vocabulary does not hold, is refused before the run,
    naming the file and row group."""
    from helpers import tiny_spec, write_dataset

    data = write_dataset(tmp_path / "data", 64, 32, shards=1, row_group_rows=8)
    spec = spec_from_dict(tiny_spec(tmp_path, data, tracking={"enabled": False}), "job.yaml")
    rows = pq.read_table(data / "part-0.parquet").column("tokens").to_pylist()
    rows[20] = rows[20] + [1]  # row group 2 of the second file
    ids = np.arange(2000, 2064)
    pq.write_table(pa.table({"sample_id": ids, "tokens": pa.array(rows, pa.list_(pa.int64()))}),
                   data / "part-1.parquet", row_group_size=8)
    with pytest.raises(SpecError, match=r"'tokens' holds list<element: int64> in .*part-1.parquet, "
                                        r"where the first file holds fixed_size_list"):
        preflight(spec, "job.yaml")
    (data / "part-0.parquet").unlink()  # lists of any length in every file
    with pytest.raises(SpecError) as e:
        preflight(spec, "job.yaml")
    assert str(e.value) == (f"job.yaml: data.token_column: 'tokens' holds rows of another length "
                            f"in row group 2 of {data}/part-1.parquet: every row must hold 33 "
                            "tokens (model.seq_len + 1)")
    rows[20] = rows[20][:-1]
    rows[5] = [300] + rows[5][1:]
    pq.write_table(pa.table({"sample_id": ids, "tokens": pa.array(rows, pa.list_(pa.int64()))}),
                   data / "part-1.parquet", row_group_size=8)
    with pytest.raises(SpecError, match=r"data.token_column: token ids in .*part-1.parquet lie in "
                                        r"\[\d+, 300\] but model.vocab_size is 256; set "
                                        r"model.vocab_size: 301 or more"):
        preflight(spec, "job.yaml")


def test_a_file_of_no_rows_is_no_unit_and_the_rest_train(tmp_path):
    """An empty file beside the corpus (a writer's empty shard) used to be a unit of no rows,
    which the run read and refused (`gives 0 values a row, not 6`); now it holds no unit."""
    data = write_table(tmp_path / "data")
    _second_file(data, lambda t: t.slice(0, 0))
    got = preflight(spec_from_dict(_spec(tmp_path, data), "job.yaml"), "job.yaml")
    manifest = Manifest.build(str(data))
    assert len(manifest.units) == 12 and manifest.num_samples == 96
    assert [len(f.row_groups) for f in manifest.files] == [12, 1]  # (pinned by the digest still)
    assert all(read_unit(str(data), u, got.columns).num_rows == 8 for u in manifest.units)


@pytest.mark.parametrize("column, value, what", [
    ("a", np.nan, "data.columns.inputs"),  # one of the concatenated features
    ("vec", np.inf, "data.columns.inputs"),  # inside a fixed-size list
    ("y", 1e39, "data.columns.target"),  # a float64 beyond float32's range
])
def test_nan_or_infinite_floats_are_refused_naming_the_row(tmp_path, column, value, what):
    """A NaN feature used to pass the checks and end the run at its first NaN loss with advice
    about the learning rate; now its row group is refused, naming the row. The first row group
    is read before Ray starts, so a value there is refused by `preflight`."""
    data = write_table(tmp_path / "data")
    table = pq.read_table(data / "table.parquet")
    values = table.column(column).combine_chunks()
    if column == "vec":
        flat = values.flatten().to_numpy().copy()
        flat[4 * 11 + 2] = value  # row 11: row group 1, its row 3
        changed = pa.FixedSizeListArray.from_arrays(pa.array(flat), 4)
    else:
        flat = values.to_numpy().astype(np.float64)
        flat[11] = value
        changed = pa.array(flat)
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, changed),
                   data / "table.parquet", row_group_size=8)
    spec = spec_from_dict(_spec(tmp_path, data, task="helpers:regression",
                                model={"name": "helpers:regressor", "width": 4, "options": {"inputs": 6}},
                                **{"data.columns": {"inputs": ["vec", "a", "b"], "target": "y"}}))
    got = preflight(spec, "job.yaml")  # row group 0 is clean
    manifest = Manifest.build(str(data))
    with pytest.raises(DataError, match=rf"table.parquet row group 1: {what} holds NaN or "
                                        r"infinite values in 1 row \(the first: row 3 of the row "
                                        r"group, counted from 0\); drop or fill them"):
        read_unit(str(data), manifest.units[1], got.columns)


def test_built_in_tasks_leave_padding_rows_out():
    shapes = {"inputs": ((3,), torch.float32), "label": ((), torch.int64)}
    batch = {"inputs": torch.randn(2, 3), "label": torch.tensor([1, 0]), VALID: torch.ones(2, dtype=torch.bool)}
    logits = torch.randn(2, 4)
    full = padded(batch, 5, shapes)
    assert full[VALID].tolist() == [True, True, False, False, False]
    task = Classification()
    loss, metrics = task.loss(torch.cat([logits, torch.randn(3, 4)]), full)
    want, want_metrics = task.loss(logits, batch)
    torch.testing.assert_close(loss, want)  # the padding rows add nothing
    assert metrics["accuracy"] == want_metrics["accuracy"]
    assert "auroc" not in metrics  # training: not counted
    two = torch.tensor([[0.0, 2.0], [1.0, -1.0]])  # row 0 (label 1) scores higher
    assert "auroc" not in task.loss(two, batch)[1]  # training (gradients on): not counted
    with torch.no_grad():  # as an evaluation runs
        _, binary = task.loss(torch.cat([two, torch.randn(3, 2)]), full)
        assert torch.equal(binary["auroc"].positives, task.loss(two, batch)[1]["auroc"].positives)
    assert binary["auroc"].positives.sum() == 1 and binary["auroc"].negatives.sum() == 1
    lm = LanguageModel(seq_len=3)
    tokens = {"tokens": torch.randint(0, 7, (2, 4)), VALID: torch.tensor([True, False])}
    out = torch.randn(2, 3, 7)
    one, _ = lm.loss(out, tokens)
    alone, _ = lm.loss(out[:1], {"tokens": tokens["tokens"][:1], VALID: torch.tensor([True])})
    torch.testing.assert_close(one, alone)


def test_the_python_api_loads_a_path_or_a_dict_with_overrides(tmp_path):
    import baton

    spec = baton.load(REPO / "jobs" / "digits.yaml", ["train.steps=7", "eval.every_steps=0"])
    assert (spec.task, spec.train.steps, spec.eval.every_steps, spec.eval.fraction) == \
        ("classification", 7, 0, 0.2)
    again = baton.load(spec.to_dict(), ["parallel.dp=1"])
    assert again.parallel.dp == 1 and again.train.steps == 7 and spec.parallel.dp == 2
    with pytest.raises(SpecError, match="train.steps"):
        baton.load({"name": "x", "train": {"steps": 0}})


@pytest.mark.parametrize("task", ["language_model", "classification"])
def test_baton_init_writes_a_job_file_that_validates(task, tmp_path, capsys):
    from baton import cli
    from baton.spec import load_spec

    assert cli.main(["init", task]) == 0
    job = tmp_path / "job.yaml"
    job.write_text(capsys.readouterr().out)
    assert load_spec(job).task == task


HF = {"name": "hf:gpt2", "seq_len": 32, "vocab_size": 256,
      "config": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32}}


@pytest.mark.parametrize("model, parallel, expected", [
    ({**HF, "name": "hf:gtp2"}, {}, "transformers has no model type 'gtp2'"),
    ({**HF, "seq_len": 64}, {}, "model.seq_len 64 is more than the 32 positions"),
    ({**HF, "options": {"head": "lm"}}, {}, "hf: models take one option, head: causal_lm"),
    (HF, {"pp": 2}, "hf: models are not an nn.Sequential"),
    ({"name": "gpt", "config": {"n_layer": 2}}, {}, "only hf: models take a configuration"),
])
def test_hf_models_are_checked_in_one_line(model, parallel, expected):
    pytest.importorskip("transformers")  # CI installs it (the test extra)
    with pytest.raises(SpecError) as e:
        spec_from_dict({"name": "t", "model": model, "parallel": parallel}, "job.yaml")
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_hf_model_is_built_from_its_configuration_and_seed():
    pytest.importorskip("transformers")
    from baton.models import build_model

    spec = spec_from_dict({"name": "t", "model": HF})
    a, b = build_model(spec.model, 3), build_model(spec.model, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    logits = a(torch.randint(0, 256, (2, 32)))
    assert logits.shape == (2, 32, 256)
    assert sum(p.numel() for p in a.parameters()) < 200_000  # 2 x 32, not GPT-2's 124M


def test_an_hf_model_takes_its_weights_from_a_local_folder(tmp_path):
    pytest.importorskip("transformers")
    from baton.models import build_model

    trained = build_model(spec_from_dict({"name": "t", "model": HF}).model, 11)
    trained.model.save_pretrained(tmp_path / "gpt2-tiny")
    spec = spec_from_dict({"name": "t", "model": {**HF, "init_from": str(tmp_path / "gpt2-tiny")}})
    loaded = build_model(spec.model, 0)  # the seed does not matter: the weights are the folder's
    for (n, a), b in zip(trained.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), n


def _ragged_table(folder, longest: int = 5):
    """`ids`: token lists of 1..longest values; `image`: a 2 x 3 Arrow tensor per row."""
    rng = np.random.default_rng(0)
    lengths = [1 + i % longest for i in range(24)]
    ids = [rng.integers(1, 50, n).tolist() for n in lengths]
    images = rng.normal(size=(24, 2, 3)).astype(np.float32)
    tensor = pa.ExtensionArray.from_storage(
        pa.fixed_shape_tensor(pa.float32(), (2, 3)),
        pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), 6))
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"ids": pa.array(ids, pa.list_(pa.int32())), "image": tensor,
                             "y": rng.normal(size=24).astype(np.float32)}),
                   folder / "t.parquet", row_group_size=8)
    return folder, ids, images


def test_variable_length_lists_are_padded_with_a_mask_and_tensors_keep_their_shape(tmp_path):
    data, ids, images = _ragged_table(tmp_path / "data")
    spec = spec_from_dict(_spec(tmp_path, data, task="helpers:regression",
                                model={"name": "helpers:regressor", "width": 4, "options": {"inputs": 6}},
                                **{"data": {"source": "parquet", "path": str(data), "id_column": None,
                                      "columns": {"inputs": "image", "tokens": "ids", "target": "y"},
                                      "pad": {"tokens": 6}}}))
    with pytest.raises(SpecError, match="the model's output on the data's inputs"):
        preflight(spec, "job.yaml")  # a Linear(6) cannot take (2, 3) images: found on meta
    raw = spec.to_dict()
    raw["data"]["columns"]["inputs"] = ["image", "y"]  # with other columns: flat features
    raw["model"]["options"]["inputs"] = 7
    got = preflight(spec_from_dict(raw), "job.yaml")
    shapes = got.columns.shapes()
    assert shapes["inputs"] == ((7,), torch.float32) and shapes["tokens"] == ((6,), torch.int64)
    assert shapes["tokens_mask"] == ((6,), torch.bool)
    unit = Manifest.build(str(data)).units[1]
    table = read_unit(str(data), unit, got.columns)
    _, columns = _arrays([table], got.columns.shapes())
    for row in range(8):
        want = ids[8 + row]
        assert columns["tokens"][row, :len(want)].tolist() == want
        assert columns["tokens"][row, len(want):].tolist() == [0] * (6 - len(want))
        assert columns["tokens_mask"][row].tolist() == [True] * len(want) + [False] * (6 - len(want))
    y = pq.read_table(data).column("y").to_numpy()[8:16]
    np.testing.assert_array_equal(columns["inputs"], np.concatenate([images[8:16].reshape(8, 6), y[:, None]], 1))


def test_a_tensor_column_alone_keeps_its_shape_and_long_rows_are_refused(tmp_path):
    data, _, images = _ragged_table(tmp_path / "data", longest=9)
    spec = spec_from_dict(_spec(tmp_path, data, task="helpers:regression",
                                model={"name": "helpers:regressor", "width": 4, "options": {"inputs": 3}},
                                **{"data": {"source": "parquet", "path": str(data), "id_column": None,
                                      "columns": {"inputs": "image", "tokens": "ids", "target": "y"},
                                      "pad": {"tokens": 8}}}))
    got = preflight(spec, "job.yaml")  # Linear(3) over the last dimension of (2, 3) images
    assert {f.name: f.shape for f in got.columns.fields}["inputs"] == (2, 3)
    manifest = Manifest.build(str(data))
    _, columns = _arrays([read_unit(str(data), manifest.units[0], got.columns)], got.columns.shapes())
    np.testing.assert_array_equal(columns["inputs"], images[:8])
    with pytest.raises(DataError, match=r"row group 1: data.columns.tokens 'ids' has a row of 9 values, "
                                        r"more than data.pad.tokens = 8"):
        read_unit(str(data), manifest.units[1], got.columns)


@pytest.mark.parametrize("pad, expected", [
    ({"target": 4}, "data.pad.target: pads one column of lists of any length"),
])
def test_padding_what_is_not_a_list_is_refused(tmp_path, pad, expected):
    data, _, _ = _ragged_table(tmp_path / "data")
    message = _refused(tmp_path, data, task="helpers:regression",
                       model={"name": "helpers:regressor", "width": 4, "options": {"inputs": 3}},
                       **{"data": {"source": "parquet", "path": str(data), "id_column": None,
                             "columns": {"inputs": "image", "tokens": "ids", "target": "y"}, "pad": pad}})
    assert expected in message, message


def test_a_pad_for_no_column_is_a_spec_error():
    with pytest.raises(SpecError, match="data.pad.x: 4 is invalid; pads a key of data.columns"):
        spec_from_dict({"name": "t", "task": "helpers:regression",
                        "data": {"source": "parquet", "columns": {"inputs": "a"}, "pad": {"x": 4}}})


def test_a_ratio_metric_is_its_sums_divided_not_a_mean_of_ratios():
    """A metric returned as (numerator, denominator) sums both over every micro-batch and
    replica, then divides (precision: true positives over predicted positives); a mean metric
    is its sum over the valid rows; a ratio with nothing below it is left out, not 0."""
    from baton.tasks import Sums, UserTask, metric_values

    task = UserTask("helpers:regression")
    replicas = []
    for rows in ([1.0, 2.0], [4.0]):  # two replicas: two micro-batches, and one
        sums = Sums()
        for row in rows:
            batch = {"target": torch.tensor([row]), VALID: torch.ones(1, dtype=torch.bool)}
            loss, metrics = task.loss(torch.ones(1, 1), batch)  # error = 1 - target
            sums.add(task, loss, metrics, batch)
        replicas.append(sums.out())
    assert replicas[0]["ratios"]["wape"] == [1.0, 3.0] and "ratios" not in Sums().out()
    values = metric_values(replicas, count=3)
    # (0 + 1 + 3) / (1 + 2 + 4); the replicas' own ratios, 1/3 and 3/4, average to 0.54
    assert values == {"abs_error": 4.0 / 3, "wape": 4.0 / 7}
    nothing = [{"metrics": {}, "ratios": {"precision": [0.0, 0.0]}}]
    assert metric_values(nothing, count=1) == {}


def _exact_auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney: each (positive, negative) pair scores 1 when the positive is higher, 0.5
    on a tie."""
    pos, neg = scores[labels], scores[~labels]
    return float(((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean())


def _exact_average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Each distinct score a threshold, from the highest: precision there times the recall it
    adds (sklearn's average_precision_score)."""
    total = 0.0
    for t in np.unique(scores)[::-1]:
        taken = scores >= t
        added = (labels & (scores == t)).sum()
        total += added * (labels & taken).sum() / taken.sum()
    return total / labels.sum()


def _counted(scores, labels, valid=None, bins=1000, parts=1) -> dict:
    """auroc and average_precision through the path a run takes: each part a replica's Sums,
    summed by metric_values."""
    from baton.tasks import Sums, UserTask, auroc, average_precision, metric_values

    task = UserTask("helpers:regression")  # any task: only per_sample is read
    valid = np.ones(len(scores), dtype=bool) if valid is None else valid
    results = []
    for idx in np.array_split(np.arange(len(scores)), parts):
        s, y, v = (torch.from_numpy(a[idx]) for a in (scores, labels, valid))
        sums = Sums()
        sums.add(task, torch.zeros(()), {"auroc": auroc(s, y, v, bins),
                                         "average_precision": average_precision(s, y, v, bins)},
                 {VALID: v})
        results.append(sums.out())
    return metric_values(results, count=int(valid.sum()))


def test_a_macro_average_is_the_mean_of_each_class_ratio_of_sums():
    """A pair of vectors (one entry a class) sums entry by entry over micro-batches and
    replicas, and its value is the mean of the classes' ratios, leaving out a class no row
    had (its denominator 0): sklearn's macro F1 over the same rows, as one batch or split
    unevenly over two replicas; and a 0-dimensional pair is still a plain ratio."""
    import torch

    from baton.tasks import Sums, UserTask, counted_once, metric_values

    def f1(output, batch):  # per class: 2 TP / (2 TP + FP + FN), classes 0..3 (3 absent)
        pred, label, valid = output.argmax(-1), batch["label"], batch["valid"]
        hit = torch.nn.functional.one_hot(pred, 4).bool() & valid[:, None]
        true = torch.nn.functional.one_hot(label, 4).bool() & valid[:, None]
        tp = (hit & true).sum(0).float()
        return {"loss": output.sum() * 0, "macro_f1": (2 * tp, hit.sum(0).float() + true.sum(0).float()),
                "precision": (tp.sum(), hit.sum().float())}

    task = UserTask.__new__(UserTask)
    task.name, task.fn = "f1", f1
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(30, 4, generator=g)
    logits[:, 3] = -10  # class 3 never predicted
    labels = torch.randint(0, 3, (30,), generator=g)  # nor present
    def sums(rows):
        s = Sums()
        for part in (rows[:len(rows) // 3], rows[len(rows) // 3:]):  # two micro-batches
            batch = {"label": labels[part], "valid": torch.ones(len(part), dtype=torch.bool)}
            loss, metrics = task.loss(logits[part], batch)
            s.add(task, loss, metrics, batch)
        return s.out()

    whole = metric_values([sums(torch.arange(30))], 30)
    split = metric_values([sums(torch.arange(11)), sums(torch.arange(11, 30)),
                           counted_once(sums(torch.arange(11, 30)))], 30)
    from sklearn.metrics import f1_score, precision_score

    pred = logits.argmax(-1).numpy()
    want = f1_score(labels.numpy(), pred, average="macro", labels=[0, 1, 2])
    # float64 ratios of exact integer counts: equal to sklearn's to rounding (measured 0 apart)
    assert whole["macro_f1"] == pytest.approx(want, abs=1e-12)
    assert split["macro_f1"] == pytest.approx(want, abs=1e-12)
    assert whole["precision"] == pytest.approx(precision_score(labels.numpy(), pred, average="micro"), abs=1e-12)
    assert metric_values([{"ratios": {"macro_f1": [[0.0, 0.0], [0.0, 0.0]]}}], 1) == {}  # no class seen


def test_counted_metrics_on_scores_at_bin_centres_are_exact():
    """Scores that each sit inside one bin (ties exactly where the scores tie): the counted
    AUROC is the Mann-Whitney statistic and the average precision sklearn's, whatever the
    split into replicas."""
    rng = np.random.default_rng(0)
    bins = 50
    scores = (rng.integers(0, bins, 2000) + 0.5) / bins
    labels = rng.random(2000) < scores  # higher scores more often positive
    for parts in (1, 3):
        got = _counted(scores, labels, bins=bins, parts=parts)
        # the same counts either way; 1e-12 leaves room for float sums in another order
        assert got["auroc"] == pytest.approx(_exact_auroc(scores, labels), abs=1e-12)
        assert got["average_precision"] == pytest.approx(_exact_average_precision(scores, labels), abs=1e-12)


def test_counted_metrics_of_continuous_scores_are_within_the_bins_resolution():
    """Continuous scores: the 1,000 bins count rows within 0.001 of each other as ties.
    Measured over seeds 0-9 of this draw (5,000 rows, printed with pytest -s): the AUROC at
    most 1.11e-5 from the exact one, the average precision at most 3.23e-4; the bounds are
    those, rounded up."""
    worst = [0.0, 0.0]
    for seed in range(10):
        rng = np.random.default_rng(seed)
        scores = rng.beta(2, 2, 5000)
        labels = rng.random(5000) < scores
        got = _counted(scores, labels, parts=2)
        worst[0] = max(worst[0], abs(got["auroc"] - _exact_auroc(scores, labels)))
        worst[1] = max(worst[1], abs(got["average_precision"] - _exact_average_precision(scores, labels)))
    print("largest differences: auroc", worst[0], "average precision", worst[1])
    assert worst[0] <= 1.2e-5 and worst[1] <= 3.3e-4


def test_counted_metrics_leave_out_padding_rows_and_a_set_without_both_classes():
    scores = np.array([0.9, 0.2, 0.8, 0.1])
    labels = np.array([True, False, False, True])
    # the last row is padding: of the rest, the positive (0.9) outranks both negatives
    assert _counted(scores, labels, valid=np.array([True, True, True, False])) == {
        "auroc": 1.0, "average_precision": 1.0}
    assert _counted(scores, np.zeros(4, dtype=bool)) == {}  # no positive row: no value
    only_positive = _counted(scores, np.ones(4, dtype=bool))
    assert "auroc" not in only_positive and only_positive["average_precision"] == 1.0


def _macro(probs, labels, bins, parts=1) -> dict:
    """macro_auroc through the path a run takes: each part a replica's Sums of two
    micro-batches (the second part's result also as `counted_once` reports it: zeros)."""
    from baton.tasks import Sums, UserTask, counted_once, macro_auroc, macro_average_precision, metric_values

    task = UserTask("helpers:regression")  # any task: only per_sample is read
    results = []
    for idx in np.array_split(np.arange(len(labels)), parts):
        sums = Sums()
        for half in np.array_split(idx, 2):
            p, y = torch.from_numpy(probs[half]), torch.from_numpy(labels[half])
            v = torch.ones(len(half), dtype=torch.bool)
            sums.add(task, torch.zeros(()), {"auroc": macro_auroc(p, y, v, bins),
                                             "ap": macro_average_precision(p, y, v, bins)}, {VALID: v})
        results.append(sums.out())
    return metric_values(results + [counted_once(results[-1])], count=len(labels))


def test_multiclass_auroc_and_average_precision_are_the_mean_of_each_class_against_the_rest():
    """macro_auroc and macro_average_precision: on scores at bin centres, each class's counted
    AUROC is the Mann-Whitney statistic of its scores on its rows against the other rows', and
    its average precision sklearn's, exactly, and their mean the metric, whatever the split; a
    class no row has is left out. On a classifier's softmax (continuous scores, 1,000 bins),
    sklearn's roc_auc_score(multi_class="ovr") and average_precision_score(one-hot labels,
    average="macro"): measured over seeds 0-9 (3,000 rows, 5 classes, printed with pytest -s)
    at most 2.91e-5 and 4.64e-4 apart; the bounds are those, rounded up."""
    from sklearn.metrics import average_precision_score, roc_auc_score

    rng = np.random.default_rng(0)
    bins, classes = 50, 4
    labels = rng.integers(0, classes - 1, 1500)  # class 3: no row
    probs = (rng.integers(0, bins, (1500, classes)) + 0.5) / bins
    probs[np.arange(1500), labels] = np.minimum(probs[np.arange(1500), labels] + 0.3, (bins - 0.5) / bins)
    probs = np.round(probs * bins - 0.5) / bins + 0.5 / bins  # back on the bins' centres
    want = np.mean([_exact_auroc(probs[:, c], labels == c) for c in range(classes - 1)])
    want_ap = np.mean([_exact_average_precision(probs[:, c], labels == c) for c in range(classes - 1)])
    for parts in (1, 3):
        # the same integer counts either way; 1e-12 leaves room for float sums in another order
        got = _macro(probs, labels, bins, parts)
        assert got["auroc"] == pytest.approx(want, abs=1e-12)
        assert got["ap"] == pytest.approx(want_ap, abs=1e-12)
    worst = worst_ap = 0.0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        labels = rng.integers(0, 5, 3000)
        logits = rng.normal(size=(3000, 5)) + 1.5 * np.eye(5)[labels]
        probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        got = _macro(probs, labels, 1000, parts=2)
        worst = max(worst, abs(got["auroc"] - roc_auc_score(labels, probs, multi_class="ovr")))
        worst_ap = max(worst_ap, abs(got["ap"] - average_precision_score(np.eye(5)[labels], probs)))
    print("largest differences from sklearn's: auroc", worst, "average precision", worst_ap)
    assert worst <= 3.0e-5 and worst_ap <= 4.7e-4


def test_a_classifier_evaluates_its_auroc_whatever_its_classes():
    """Classification at evaluation (no gradients): two classes, class 1's AUROC; more, the
    one-vs-rest mean (`macro_auroc`); training, neither."""
    from baton.tasks import Classification

    task = Classification()
    batch = {"label": torch.tensor([0, 2, 1]), VALID: torch.ones(3, dtype=torch.bool)}
    logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 3.0, 0.0]])  # each right
    assert "auroc" not in task.loss(logits, batch)[1]
    with torch.no_grad():
        counts = task.loss(logits, batch)[1]["auroc"]
    from baton.tasks import Sums, metric_values

    sums = Sums()
    sums.add(task, torch.zeros(()), {"auroc": counts}, batch)
    assert counts.kind == "macro_auroc" and metric_values([sums.out()], 3)["auroc"] == 1.0


def test_a_task_that_takes_its_valid_rows_by_a_mask_passes_the_check_before_ray(tmp_path):
    """`loss[batch["valid"]].sum()` (docs/tasks.md's examples) has a data-dependent shape, which
    the meta device refused: `baton validate` used to reject the documented F1 task with
    torch's NotImplementedError for nonzero. Counted metrics pass the check too."""
    data = write_table(tmp_path / "data")
    spec = spec_from_dict(_spec(tmp_path, data, task="helpers:binary", **{
        "model.options": {"inputs": 6, "classes": 2}}))
    assert preflight(spec, "job.yaml").manifest.num_samples == 96


def test_a_loss_mask_is_checked_before_the_run_and_as_its_rows_are_read(tmp_path):
    """data.loss_mask_column: a column of seq_len + 1 zeros and ones a row beside the tokens.
    One that is not there, of another length, or of other values is one line before the
    run; a row group whose values the footers did not record is refused as it is read. The
    task's loss is the mean over the tokens it marks (0 apart from the loss over those
    tokens alone), and counts them."""
    from helpers import tiny_spec, write_dataset

    data = write_dataset(tmp_path / "data", 16, 32, shards=1, row_group_rows=8)
    table = pq.read_table(data / "part-0.parquet")
    mask = (np.arange(33)[None, :] >= 20).repeat(16, axis=0).astype(np.uint8)  # the last 13 tokens

    def job(**data_section):
        return spec_from_dict(tiny_spec(tmp_path, data, tracking={"enabled": False},
                                        data={"loss_mask_column": "mask", **data_section}), "job.yaml")
    for values, message in (
            (None, "data.loss_mask_column: 'mask' is not a column of"),
            (mask[:, :32], "data.loss_mask_column: rows of 'mask' hold 32 values, and of 'tokens' "
                           "33: a loss mask marks each token of its row"),
            (mask * 2, "data.loss_mask_column: values in {data}/part-0.parquet lie in [0, 2]; a "
                       "loss mask holds 1 where a token is a target, 0 where not")):
        columns = {n: table.column(n) for n in table.column_names}
        if values is not None:
            columns["mask"] = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
        pq.write_table(pa.table(columns), data / "part-0.parquet", row_group_size=8)
        with pytest.raises(SpecError) as e:
            preflight(job(), "job.yaml")
        assert message.format(data=data) in str(e.value) and "\n" not in str(e.value), str(e.value)
    columns["mask"] = pa.FixedSizeListArray.from_arrays(pa.array(mask.reshape(-1).astype(bool)), 33)
    pq.write_table(pa.table(columns), data / "part-0.parquet", row_group_size=8)
    found = preflight(job(), "job.yaml")  # (booleans do as well as integers)
    manifest = Manifest.build(str(data))
    unit = read_unit(str(data), manifest.units[0], found.columns)
    assert unit.column("loss_mask").to_pylist()[0] == mask[0].tolist()
    task = LanguageModel(32, masked=True)
    torch.manual_seed(0)
    logits = torch.randn(2, 32, 256)
    tokens = torch.from_numpy(np.stack(table.column("tokens").to_pylist()[:2])).long()
    batch = {"tokens": tokens, "loss_mask": torch.from_numpy(mask[:2]).long(),
             VALID: torch.tensor([True, False])}  # (the second row: padding)
    loss, _ = task.loss(logits, batch)
    want = torch.nn.functional.cross_entropy(logits[0, 19:], tokens[0, 20:], reduction="sum")
    assert torch.equal(loss, want) and int(task.count(batch)) == 13
    assert task.targets({"loss_mask": mask[:2]}) == 26  # (rows as read: both counted)
