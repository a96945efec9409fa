"""The ``replica`` command line."""

from __future__ import annotations

import json

import torch

from replica.cli import main


def tiny_factory():
    """A factory the CLI loads by name: returns (model, example_inputs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, (torch.randn(4, 8),)


def test_plan_prints_a_summary_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "tests.test_cli:tiny_factory", "--num-stages", "2", "--device", "a100-80gb",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 stages" in text and "balance" in text
    assert json.loads(out.read_text())["layout"]["num_stages"] == 2


def test_plan_with_a_world_size(capsys):
    assert main(["plan", "tests.test_cli:tiny_factory", "--world-size", "4", "--num-stages", "2",
                 "--device", "a100-80gb"]) == 0
    assert "2 replicas" in capsys.readouterr().out


def test_bad_factory_is_a_clear_error(capsys):
    assert main(["plan", "tests.test_cli:nothing_here"]) == 2
    assert "nothing_here" in capsys.readouterr().err
    assert main(["plan", "no_colon"]) == 2
    assert "MODULE:FACTORY" in capsys.readouterr().err


def test_plan_writes_the_html_report(tmp_path, capsys):
    out = tmp_path / "p.html"
    assert main(["plan", "tests.test_cli:tiny_factory", "--num-stages", "2", "--device", "a100-80gb",
                 "--html", str(out)]) == 0
    assert 'data-stage="1"' in out.read_text()


def test_export_names_the_step_it_exported(tmp_path, capsys) -> None:
    from tests.train_cases import run

    run(tmp_path / "ckpt", epochs=1)  # steps 2 and 3 saved: the newest is exported
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "one")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"exported step 3 ({tmp_path / 'ckpt' / 'step-00000003'}) to "), out
    assert main(["export", str(tmp_path / "ckpt" / "step-00000002"), str(tmp_path / "shards"),
                 "--max-shard-size", "4000"]) == 0
    assert capsys.readouterr().out.startswith("exported step 2 ("), "a sharded export's index names it too"
