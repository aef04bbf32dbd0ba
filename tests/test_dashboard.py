"""What MLflow's dashboard shows of the main job: SipIt vs head columns on the parent run, the prompt
set as a dataset input, the experiment's description and saved view, a sweep's curves as metric history."""

from __future__ import annotations

import json

import mlflow.data
import pandas as pd
from mlflow import MlflowClient

from benchmarks import run as bench
from benchmarks.run import run_benchmark
from benchmarks.tracking import (NOTE_HEADING, NOTE_TAG, PROMPTS_ARTIFACT, VIEW_KEY, VIEW_TAG_PREFIX, Tracker,
                                 prompts_frame)

QUIET = dict(progress=False, log=lambda *a, **k: None)


def _dataset(client: MlflowClient, run_id: str):
    (only,) = client.get_run(run_id).inputs.dataset_inputs
    return only


def test_parent_run_has_every_attack_under_one_name_and_the_prompts_as_its_dataset(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    results = run_benchmark(model="tiny-llama", defense="noise", sigma_rel=0.01, attacks="sipit,softmax-head,inverse-head",
                            robust="radius", n_prompts=2, length=6, head_tokens=256, head_epochs=2, margin_positions=2,
                            utility_tokens=64, tracking_uri=uri, experiment="dash", out=tmp_path / "out", **QUIET)
    client = MlflowClient(tracking_uri=uri)
    run_id = results["tracking"]["run_id"]
    metrics = client.get_run(run_id).data.metrics
    attacks = ("sipit", "softmax-head", "softmax-head-adaptive", "inverse-head")
    for attack in attacks:  # one column per attack and rate: <attack>.<rate>, the rate as the attack's run names it
        child = client.search_runs([client.get_run(run_id).info.experiment_id],
                                   f"tags.mlflow.parentRunId = '{run_id}' and tags.attack = '{attack}'")[0]
        for rate in ("token_accuracy", "exact_match", "token_accuracy_upper95"):
            assert metrics[f"{attack}.{rate}"] == results["attacks"][attack][rate] == child.data.metrics[rate]
    assert metrics["sipit.token_accuracy"] == 1.0  # 1% of the state RMS: SipIt recovers every token

    # the prompt set: a dataset input (name, digest of the rows, schema, row count) and its rows as an artifact
    entry = _dataset(client, run_id)
    assert {t.key: t.value for t in entry.tags} == {"mlflow.data.context": "eval"}
    assert entry.dataset.name == "prompts-mixed-2x6" and json.loads(entry.dataset.profile)["num_rows"] == 2
    columns = {c["name"] for c in json.loads(entry.dataset.schema)["mlflow_colspec"]}
    assert {"prompt", "kind", "text", "token_ids", "n_tokens"} <= columns
    assert json.loads(entry.dataset.source)["tags"]["artifact"] == PROMPTS_ARTIFACT
    rows = pd.read_csv(client.download_artifacts(run_id, PROMPTS_ARTIFACT, str(tmp_path)), keep_default_na=False)
    assert [json.loads(ids) for ids in rows["token_ids"]] == [p["truth_ids"] for p in results["prompts"]]
    assert list(rows["text"]) == [p["truth_text"] for p in results["prompts"]]
    # the artifact holds the dataset's rows: they hash to its digest
    again = prompts_frame([{"index": r.prompt, "kind": r.kind, "text": r.text, "ids": json.loads(r.token_ids),
                            "spans": json.loads(r.private_spans)} for r in rows.itertuples()])
    assert mlflow.data.from_pandas(again).digest == entry.dataset.digest


def test_experiment_has_its_description_and_the_side_by_side_view_and_keeps_a_users_note(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "described")
    client = MlflowClient(tracking_uri=uri)
    tags = client.get_experiment(tracker.experiment_id).tags
    note = tags[NOTE_TAG]
    assert note.startswith(NOTE_HEADING) and f"/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY})" in note
    assert "`sipit.token_accuracy`" in note and "`softmax-head.token_accuracy`" in note and "fraction" in note
    view = json.loads(tags[VIEW_TAG_PREFIX + VIEW_KEY])
    columns = view["selectedColumns"]
    assert columns == view["columnOrder"] and "attributes.`Dataset`" in columns
    i = columns.index("metrics.`sipit.token_accuracy`")
    assert columns[i + 1] == "metrics.`softmax-head.token_accuracy`"  # side by side

    client.set_experiment_tag(tracker.experiment_id, NOTE_TAG, NOTE_HEADING + "\n(an older version of ours)")
    Tracker(uri, "described")  # found again: our own older description is brought up to date
    assert client.get_experiment(tracker.experiment_id).tags[NOTE_TAG] == note
    client.set_experiment_tag(tracker.experiment_id, NOTE_TAG, "my own notes")
    Tracker(uri, "described")  # a description someone wrote stays
    assert client.get_experiment(tracker.experiment_id).tags[NOTE_TAG] == "my own notes"


def test_sweep_parent_run_draws_each_attack_against_the_setting(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = ["--model", "tiny-llama", "--n-prompts", "2", "--length", "6", "--attacks", "sipit,inverse-head",
            "--utility-tokens", "64", "--margin-positions", "2", "--no-progress", "--defense", "noise",
            "--sigma-rel", "0.01,30", "--robust", "radius", "--tracking-uri", uri, "--experiment", "swept",
            "--out", str(tmp_path / "sweep")]
    assert bench.main(argv) == 0
    summary = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    client = MlflowClient(tracking_uri=uri)
    parent = summary["run_id"]
    swept = [s["values"]["noise.sigma"] for s in summary["settings"]]
    assert [(m.step, m.value) for m in client.get_metric_history(parent, "sweep.noise.sigma")] == list(enumerate(swept))
    for attack in ("sipit", "inverse-head"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(parent, f"{attack}.token_accuracy"))
        rows = [r for r in summary["rows"] if r["attack"] == attack]
        assert history == [(i, r["token_accuracy"]) for i, r in enumerate(rows)]
    sipit = dict(sorted((m.step, m.value) for m in client.get_metric_history(parent, "sipit.token_accuracy")))
    assert sipit[0] == 1.0 and sipit[1] < 1.0  # the curve falls: noise 30 x RMS breaks SipIt
    assert _dataset(client, parent).dataset.name == "prompts-mixed-2x6"  # every setting attacks the same prompts
