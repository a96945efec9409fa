"""Tests of the plan report (``replica.viz``): the HTML file, the module boxes, the figures, the
PNG export, and (marked ``browser``) the report rendered in headless Chromium."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import replica
from examples.gpt.model import GPT, GPTConfig, loss_fn
from replica.partition.trace import trace
from replica.planner.costs import stage_costs_from_plan
from replica.schedules.schedule import make_schedule
from replica.schedules.simulate import simulate
from replica.viz.chrome import measured_timeline
from replica.viz.figures import figures, format_bytes, nice_ticks
from replica.viz.modules import MAX_TOP_LEVEL_BOXES, OpInfo, ops_of, stage_boxes
from replica.viz.report import render_html, visualize
from tests.conftest import COMPUTE_BOUND

NUM_STAGES = 4


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32))
    idx = torch.randint(0, 256, (8, 32))  # (B, T)
    plan = replica.plan(model, (idx,), num_stages=NUM_STAGES, device="a100-80gb", cost="analytic")
    return model, idx, plan, trace(model, (idx,)).graph


@pytest.fixture(scope="module")
def html(gpt) -> str:
    _, _, plan, graph = gpt
    return render_html(plan, graph=graph)


@pytest.fixture(scope="module")
def gpt96():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=96, n_embd=64, n_head=4, vocab_size=256, block_size=64))
    idx = torch.randint(0, 256, (8, 64), device="meta")
    return replica.plan(model, (idx,), num_stages=8, device="a100-80gb", cost="analytic")


def section(html: str, cls: str, attr: str, k: int) -> str:
    match = re.search(rf'<section class="{cls}" data-{attr}="{k}".*?</section>', html, re.S)
    assert match, f"no {cls} section {k}"
    return match.group(0)


# --------------------------------------------------------------------------- the HTML report


def test_visualize_is_public():
    assert replica.visualize is visualize and "visualize" in replica.__all__


def test_visualize_writes_the_file(gpt, tmp_path):
    out = visualize(gpt[2], tmp_path / "plan.html")
    assert out == tmp_path / "plan.html"
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")


def test_html_says_whether_and_why_the_stages_compile(gpt, html):
    assert "compile: off (compile=None for a model on the CPU" in html  # the planner's rule, in the header
    model, idx, _, graph = gpt
    compiled = replica.plan(model, (idx,), num_stages=NUM_STAGES, device="a100-80gb", cost="analytic", compile=True)
    assert "compile: every stage through torch.compile (compile=True)" in render_html(compiled, graph=graph)


def test_html_is_self_contained(html):
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html and not re.search(r"<script[^>]*\bsrc=", html) and "@import" not in html


def test_html_has_a_section_per_stage(gpt, html):
    plan = gpt[2]
    assert re.findall(r'<section class="stage" data-stage="(\d+)"', html) == [str(k) for k in range(NUM_STAGES)]
    for s in plan.stages:
        text = section(html, "stage", "stage", s.stage_index)
        assert f"{s.num_ops} ops" in text and f"rank {s.stage_index}" in text


def test_html_lists_every_tensor_of_every_cut(gpt, html):
    plan = gpt[2]
    assert plan.num_stages > 1
    for k in range(plan.num_stages - 1):
        text = section(html, "cut", "cut", k)
        crossing = [b for s in plan.stages[: k + 1] for b in s.outputs if max(b.destination_stages) > k]
        assert crossing, f"nothing crosses cut {k}"
        for b in crossing:
            row = re.search(rf"<tr><td><code>{re.escape(b.name)}</code>.*?</tr>", text).group(0)
            assert f"({', '.join(map(str, b.shape))})" in row and b.dtype in row
            assert format_bytes(b.nbytes) in row
            assert f"{b.source_stage} → {', '.join(map(str, b.destination_stages))}" in row


def test_html_shows_the_simulated_timeline(gpt, html):
    plan = gpt[2]
    assert 'aria-label="pipeline timeline"' in html and 'id="idle"' in html
    timeline = simulate(make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches),
                        stage_costs_from_plan(plan, make_schedule(plan.schedule, plan.num_stages,
                                                                  plan.num_microbatches)))
    for e in timeline.events:
        assert f"<title>{e.action}: stage {e.action.stage_index}" in html
    assert f"bubble {timeline.bubble_fraction:.0%}" in html


def test_html_shows_time_and_memory_bars(gpt, html):
    plan = gpt[2]
    assert 'aria-label="time per stage"' in html and 'aria-label="memory per stage"' in html
    assert f"balance {plan.balance:.2f}" in html
    for k in range(plan.num_stages):
        for part in ("parameters", "gradients", "optimizer", "activations"):
            assert f"<title>stage {k} {part}: " in html
        for part in ("forward", "backward", "communication"):
            assert f"<title>stage {k} predicted {part}: " in html


def test_module_boxes_open_down_to_every_op(gpt, html):
    _, _, plan, graph = gpt
    for node in graph.op_nodes:
        assert f'<li class="op">{node.name} ' in html
    assert 'data-module="transformer.h.1"' in html


def test_without_a_graph_every_node_is_listed(gpt):
    plan = gpt[2]
    text = render_html(plan)
    for s in plan.stages:
        stage = section(text, "stage", "stage", s.stage_index)
        for name in s.node_names:
            assert f'<li class="op">{name} ' in stage
    assert "pass graph=" in text


def test_module_paths_inferred_from_names_match_the_graph(gpt):
    _, _, plan, graph = gpt
    inferred = {op.name: op.module_path for op in ops_of(plan)}
    exact = {op.name: op.module_path for op in ops_of(plan, graph)}
    assert {name: inferred[name] for name in exact} == exact


def test_a_graph_from_another_model_is_refused(gpt):
    other = GPT(GPTConfig(n_layer=5, n_embd=64, n_head=4, vocab_size=256, block_size=32))
    graph = trace(other, (gpt[1],)).graph
    with pytest.raises(replica.ConfigError, match="the graph the plan was made from"):
        render_html(gpt[2], graph=graph)


# --------------------------------------------------------------------------- module boxes


def test_96_layers_collapse_to_blocks_under_200_boxes(gpt96):
    text = render_html(gpt96)
    boxes = text.count('data-level="0"')
    assert 96 <= boxes < 200
    assert len(re.findall(r'<section class="stage" data-stage="\d+"', text)) == 8
    depth, by_stage = stage_boxes(ops_of(gpt96), 8)
    assert depth == 3 and sum(map(len, by_stage)) == boxes
    assert {b.path for stage in by_stage for b in stage} >= {f"transformer.h.{i}" for i in range(96)}


def test_too_many_top_level_modules_are_bundled():
    ops = [OpInfo(f"op{i}", str(i), i * 3 // 1000) for i in range(1000)]  # 1000 modules in 3 stages
    depth, boxes = stage_boxes(ops, 3)
    assert depth == 1 and 3 <= sum(map(len, boxes)) <= MAX_TOP_LEVEL_BOXES
    assert [op.name for stage in boxes for b in stage for op in b.ops] == [op.name for op in ops]
    assert all(b.title == f"{b.ops[0].module_path} … {b.ops[-1].module_path}" for b in boxes[0] if b.num_ops > 1)


def test_a_stage_that_is_one_block_opens_it():
    ops = [OpInfo(f"a{i}", f"h.{i // 3}.{'xyz'[i % 3]}", i // 3) for i in range(9)]  # stage k = block k
    depth, boxes = stage_boxes(ops, 3)
    assert depth == 3 and [len(b) for b in boxes] == [3, 3, 3]


# --------------------------------------------------------------------------- figures


def test_chrome_trace_of_the_simulated_timeline_validates(gpt, html):
    fig = figures(gpt[2])
    trace_ = fig.timeline.to_chrome_trace(name="GPT")
    events = trace_["traceEvents"]
    assert events and all({"ph", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(map(len, fig.schedule)) == 2 * NUM_STAGES * gpt[2].num_microbatches
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    json.dumps(trace_)
    embedded = re.search(r'href="data:application/json;base64,([^"]+)"', html).group(1)
    assert json.loads(base64.b64decode(embedded)) == json.loads(json.dumps(trace_))


def test_a_pipeline_model_draws_its_own_schedule(gpt):
    model, idx, _, graph = gpt
    pm = replica.auto_parallel(model, (idx,), num_stages=4, num_microbatches=4, schedule="interleaved",
                               loss_fn=loss_fn, device="a100-80gb", cost="analytic")
    fig = figures(pm)
    assert fig.plan is pm.plan and fig.timeline.num_ranks == len(pm.schedule) == 2
    text = render_html(pm, graph=trace(model, (idx,)).graph)
    assert "stages 0, 2" in text and "stages 1, 3" in text
    assert len(re.findall(r'<section class="stage" data-stage="\d+"', text)) == 4


def test_a_plan_draws_the_schedule_it_runs(gpt):
    """A bare plan's report draws what its pipeline runs: the order its own stage times give,
    on its pipeline ranks, with its graded micro-batch sizes (as the plan predicted its step)."""
    from replica.pipeline_model import plan_schedule

    model, idx, _, _ = gpt
    plan = replica.plan(model, (idx,), num_stages=4, num_microbatches=4, schedule="zb-v", device="a100-80gb",
                        cost="analytic")
    plan = dataclasses.replace(plan, microbatch_shares=(1 / 8, 3 / 8, 3 / 8, 1 / 8))
    fig = figures(plan)
    schedule = plan_schedule(plan)
    assert fig.schedule == schedule and fig.timeline.num_ranks == 2
    graded = simulate(schedule, stage_costs_from_plan(plan, schedule), sizes=[0.5, 1.5, 1.5, 0.5])
    assert fig.timeline.step_time_s == pytest.approx(graded.step_time_s)
    assert graded.step_time_s != pytest.approx(simulate(schedule, stage_costs_from_plan(plan, schedule)).step_time_s)


def test_measured_times(gpt):
    plan = gpt[2]
    seconds = [s.predicted_time_s * 1.5 for s in plan.stages]
    text = render_html(plan, measured=seconds)
    assert all(f"<title>stage {k} measured: " in text for k in range(NUM_STAGES))
    split = [{"forward": 1e-3, "backward": 2e-3, "communication": 1e-4}] * NUM_STAGES
    assert "<title>stage 0 measured backward: 2 ms</title>" in render_html(plan, measured=split)
    fig = figures(plan)
    records = [(e.rank, str(e.action), 10 + 2 * e.start_s, 10 + 2 * e.end_s) for e in fig.timeline.events]
    text = render_html(plan, measured=measured_timeline(records))
    assert text.count('aria-label="pipeline timeline"') == 2 and "Measured · step" in text
    for bad in ([1.0] * (NUM_STAGES - 1), [-1.0] * NUM_STAGES, [{"fwd": 1.0}] * NUM_STAGES, "fast"):
        with pytest.raises(replica.ConfigError, match="measured"):
            render_html(plan, measured=bad)


def test_memory_budget_line(gpt):
    plan = gpt[2]
    peak = max(s.memory.total for s in plan.stages)
    assert "<title>stage 0 budget" in render_html(plan, memory_budget=2 * peak)
    assert "off the scale" in render_html(plan)  # the A100's 80 GiB against a few MiB
    per_stage = [2 * peak, 3 * peak, 2 * peak, 2 * peak]
    assert f"<title>stage 1 budget {format_bytes(3 * peak)}</title>" in render_html(plan, memory_budget=per_stage)
    with pytest.raises(replica.ConfigError, match="memory_budget"):
        render_html(plan, memory_budget=[peak])


def test_a_plan_for_a_custom_device_needs_it(gpt):
    model, idx, _, _ = gpt
    plan = replica.plan(model, (idx,), num_stages=2, device=COMPUTE_BOUND, cost="analytic")
    with pytest.raises(replica.ConfigError, match="device=spec"):
        render_html(plan)
    assert 'data-stage="1"' in render_html(plan, device=COMPUTE_BOUND)


def test_not_a_plan():
    with pytest.raises(replica.ConfigError, match="replica.Plan"):
        render_html("plan.json")


def test_nice_ticks():
    assert nice_ticks(6.9e-3) == pytest.approx([0, 2e-3, 4e-3, 6e-3, 8e-3])
    assert nice_ticks(1.9 * 2**20, binary=True) == [0, 2**19, 2**20, 1.5 * 2**20, 2 * 2**20]
    assert nice_ticks(0) == [0.0, 1.0]


# --------------------------------------------------------------------------- PNG


def test_png_export(gpt, tmp_path):
    pytest.importorskip("matplotlib")
    from replica.viz.png import save_png

    out = save_png(gpt[2], tmp_path / "plan.png", measured=[s.predicted_time_s for s in gpt[2].stages], dpi=60)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert save_png(gpt[2], tmp_path / "t.png", charts=["timeline"], dpi=40).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(replica.ConfigError, match="charts"):
        save_png(gpt[2], tmp_path / "x.png", charts=["pie"])


def test_png_without_matplotlib_says_how_to_install(gpt, tmp_path, monkeypatch):
    from replica.viz.png import save_png

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(replica.ReplicaError, match=re.escape('pip install "replica[viz]"')):
        save_png(gpt[2], tmp_path / "plan.png")


# --------------------------------------------------------------------------- in a browser


def _colours(png: bytes) -> int:
    """Distinct RGB colours of a PNG: decoded by matplotlib where it is installed, else by hand
    (8-bit RGB or RGBA, non-interlaced, as Chromium writes them; its top 600 rows, every 4th)."""
    try:
        import io

        import matplotlib.image
        import numpy as np

        rgb = (matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(np.uint32)
        return len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]))
    except ImportError:
        pass
    width, height, depth, kind = struct.unpack(">IIBB", png[16:26])
    assert depth == 8 and kind in (2, 6), "expected 8-bit RGB(A)"
    idat, pos = b"", 8
    while pos < len(png):
        length, tag = struct.unpack(">I4s", png[pos:pos + 8])
        idat += png[pos + 8:pos + 8 + length] if tag == b"IDAT" else b""
        pos += 12 + length
    raw, bpp = zlib.decompress(idat), 3 if kind == 2 else 4
    stride, prev, seen = width * bpp, bytearray(width * bpp), set()
    for y in range(min(height, 600)):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pred = (0, a, b, (a + b) // 2, a if abs(p - a) <= abs(p - b) and abs(p - a) <= abs(p - c)
                    else b if abs(p - b) <= abs(p - c) else c)[f]
            line[i] = (line[i] + pred) & 0xFF
        if y % 4 == 0:
            seen.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp))
        prev = line
    return len(seen)


@pytest.mark.browser
@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not on PATH")
def test_report_renders_in_chromium(gpt, tmp_path):
    _, _, plan, graph = gpt
    page = visualize(plan, tmp_path / "plan.html", graph=graph)
    flags = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "plan.png"
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1400,1800", page.as_uri()],
                   check=True, capture_output=True, timeout=180)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1400, 1800)
    assert _colours(png) > 50, "the screenshot is (nearly) blank"
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], check=True, capture_output=True, text=True,
                         timeout=180).stdout
    stages = re.findall(r'<section class="stage" data-stage="(\d+)"', dom)
    assert stages == [str(k) for k in range(plan.num_stages)]
    assert dom.count('aria-label="pipeline timeline"') == 1 and len(re.findall(r'data-cut="\d+"', dom)) == 3


def test_docs_script_exists():
    assert (Path(__file__).resolve().parent.parent / "docs" / "make_report.py").is_file()


def test_a_pipeline_or_a_trainer_is_drawn_from_its_own_traced_graph(tmp_path):
    from tests.train_cases import images, make_trainer

    trainer = make_trainer(batch_size=16, num_stages=2)
    with pytest.raises(replica.ConfigError, match="train_dataset"):
        render_html(trainer)  # no pipeline before the first batch
    trainer.train_dataset(*images(32), epochs=1)
    pm = trainer.pipeline
    text = render_html(trainer)
    assert "pass graph=" not in text and text == render_html(pm) == render_html(pm, graph=pm.graph)
    for node in pm.graph.op_nodes:  # every op under the module the graph says, none guessed from its name
        assert f'<li class="op">{node.name} ' in text
    assert visualize(trainer, tmp_path / "plan.html").read_text() == text
