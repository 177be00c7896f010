"""`dtype: auto` (specdec/core/models.py): a model is served in the fastest of its exact formats on
this machine, measured once and kept in the cache directory per CPU, model, candidates and
kernel source; the config refuses it off the CPU."""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import threading

import pytest
import torch

from specdec.core import models
from specdec.core.engine import engine_for
from specdec.core.hub import load_model_weights_only
from specdec.core.models import ModelSpec, load_model
from specdec.serving.config import ConfigError, config_from_dict
from tests.test_kquants import write_gguf
from tests.tiny_models import build_model_dir, build_tokenizer

BOTH = ["gguf", "int8"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny model 256 wide (K-quant rows) and a GGUF file of its linears as Q4_K/Q6_K blocks: the
    directory holds what the file dequantizes to, as the converted copy of a real GGUF does."""
    root = tmp_path_factory.mktemp("auto_format")
    model = load_model_weights_only(str(build_model_dir(root / "base", seed=3, width=256)), torch.float32).eval()
    write_gguf(root / "model.gguf", model, {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}, seed=7)
    model.save_pretrained(root / "model")
    build_tokenizer().save_pretrained(root / "model")
    return str(root / "model"), root / "model.gguf"


@pytest.fixture
def gguf_source(tiny_gguf, monkeypatch, tmp_path):
    """The tiny model's directory, standing for a GGUF source (its file found as a real source's
    is), with choices kept under tmp_path."""
    directory, gguf = tiny_gguf
    monkeypatch.setattr(models, "gguf_file_of", lambda source: gguf if source == directory else None)
    monkeypatch.setattr(models, "gguf_layer_formats", lambda source: {"Q4_K", "Q6_K"} if source == directory else None)
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    return directory


def no_timing(*args, **kwargs):
    raise AssertionError("timed a pass where the choice was known")


def logits_of(model) -> torch.Tensor:
    engine = engine_for(model, model.weight_format)
    with torch.inference_mode():
        return engine(engine.new_cache(), [1, 5, 7, 3, 9, 4], num_logits=3)[0]


def test_auto_serves_the_faster_candidate_and_keeps_the_choice(gguf_source, monkeypatch, caplog):
    spec = ModelSpec(gguf_source, dtype="auto")
    assert models.exact_formats(spec) == BOTH
    with caplog.at_level(logging.INFO, logger=models.__name__):
        model = load_model(spec)
    assert model.weight_format in BOTH
    assert f"dtype auto for {gguf_source}: {model.weight_format} (measured" in caplog.text
    record = json.loads(models.format_choice_path(spec, BOTH).read_text())
    times = record["times_ms"]
    assert record["choice"] == model.weight_format and set(times) == set(BOTH)
    assert all(set(t) == {"T(1)", "T(9)"} and min(t.values()) > 0 for t in times.values())
    assert record["choice"] == models.choose_format(times)
    # served exactly as that format named outright
    assert torch.equal(logits_of(model), logits_of(load_model(dataclasses.replace(spec, dtype=model.weight_format))))

    # The second start times nothing and follows the kept choice, whichever it is.
    monkeypatch.setattr(models, "pass_times", no_timing)
    assert load_model(spec).weight_format == model.weight_format
    other = next(f for f in BOTH if f != model.weight_format)
    models.format_choice_path(spec, BOTH).write_text(json.dumps({**record, "choice": other}))
    assert load_model(spec).weight_format == other
    assert models.weight_format_of(spec) == other and models.weight_format_of(dataclasses.replace(spec, dtype="int8")) == "int8"


def test_one_process_measures_at_a_time(gguf_source, monkeypatch, tmp_path):
    """A load that finds another measuring waits, then takes the choice that one kept."""
    monkeypatch.setattr(models, "pass_times", no_timing)
    spec = ModelSpec(gguf_source, dtype="auto")
    lock = tmp_path / "formats" / "measuring.lock"
    lock.parent.mkdir()
    loaded = []
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process measuring
        threads = torch.get_num_threads()

        def load_as_a_service_does():  # its compute thread sets the thread count the choice is kept for
            torch.set_num_threads(threads)
            loaded.append(load_model(spec))

        waiter = threading.Thread(target=load_as_a_service_does)
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not loaded
        models.format_choice_path(spec, BOTH).write_text(json.dumps({"choice": "int8", "times_ms": {}}))  # what it chose
    waiter.join(120)
    assert loaded[0].weight_format == "int8"


def test_one_candidate_is_not_measured(tmp_path, monkeypatch):
    """A model that is no GGUF file has int8 alone: no timing, no kept choice."""
    monkeypatch.setattr(models, "pass_times", no_timing)
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path / "cache")
    spec = ModelSpec(str(build_model_dir(tmp_path / "model", seed=1)), dtype="auto")
    assert models.exact_formats(spec) == ["int8"]
    assert load_model(spec).weight_format == "int8"
    assert not list((tmp_path / "cache").glob("formats/*.json"))


def test_the_choice_is_kept_per_kernel_source_model_and_candidates(gguf_source, monkeypatch, tmp_path):
    monkeypatch.setattr(models, "native", lambda: object())  # kernels built (else the key says "torch ops")
    spec = ModelSpec(gguf_source, dtype="auto")
    before = models.format_choice_path(spec, BOTH)
    assert models.format_choice_path(spec, BOTH) == before
    assert models.format_choice_path(spec, ["int8"]) != before
    assert models.format_choice_path(dataclasses.replace(spec, source=gguf_source + "-other"), BOTH) != before
    changed = models.kernel_sources()
    changed["kquants.h"] += "\n// another kernel\n"
    monkeypatch.setattr(models, "kernel_sources", lambda: changed)
    assert models.format_choice_path(spec, BOTH) != before


def test_the_services_report_the_format_they_serve(gguf_source, monkeypatch):
    from drafter_service.model_drafter import ModelDrafter
    from specdec.serving.wire import model_info
    from verifier_service.verifier import Verifier

    spec = ModelSpec(gguf_source, dtype="auto")
    path = models.format_choice_path(spec, BOTH)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"choice": "gguf", "times_ms": {}}))
    monkeypatch.setattr(models, "pass_times", no_timing)
    verifier = Verifier(spec)
    assert model_info(verifier, verifier.sessions, gguf_source).weight_format == "gguf"
    assert ModelDrafter(spec).info.weight_format == "gguf"
    named = Verifier(dataclasses.replace(spec, dtype="int8"))
    assert model_info(named, named.sessions, gguf_source).weight_format == "int8"


@pytest.mark.parametrize("section", ["verifier", "drafter"])
def test_the_config_takes_auto_on_the_cpu_only(section):
    model = {"source": "some-model", "dtype": "auto"}
    config = config_from_dict({section: {"model": model}})
    assert getattr(config, section).model.dtype == "auto"
    with pytest.raises(ConfigError, match=f"{section}.model.dtype auto picks the fastest of the CPU's exact formats; on cuda name one"):
        config_from_dict({section: {"model": {**model, "device": "cuda"}}})


def test_the_config_refuses_auto_for_a_feature_head():
    with pytest.raises(ConfigError, match="drafter.model.dtype auto picks a drafter model's fastest exact format; a feature head"):
        config_from_dict({"drafter": {"model": {"dtype": "auto"}}})  # the default drafter: the feature head


def test_the_rule_takes_the_smallest_sum_and_keeps_the_files_blocks_in_a_near_tie():
    assert models.choose_format({"gguf": {"T(1)": 55.5, "T(9)": 91.2}, "int8": {"T(1)": 64.3, "T(9)": 69.0}}) == "int8"  # 9% faster
    assert models.choose_format({"gguf": {"T(1)": 54.3, "T(9)": 84.0}, "int8": {"T(1)": 59.4, "T(9)": 78.6}}) == "gguf"  # a tie
    assert models.choose_format({"gguf": {"T(1)": 40.0, "T(9)": 50.0}, "int8": {"T(1)": 60.0, "T(9)": 70.0}}) == "gguf"


def test_no_measurement_runs_beside_a_load(gguf_source, monkeypatch, tmp_path):
    """A model loading anywhere on the machine holds the turn shared: a measurement waits for it
    (an int8 model's calibration beside it made a drafter's timings noise), and it waits for a
    measurement."""
    spec = ModelSpec(gguf_source, dtype="auto")
    measured = []
    monkeypatch.setattr(
        models, "_measure_fastest", lambda spec: measured.append(spec) or load_model(dataclasses.replace(spec, dtype="int8"))
    )
    lock = tmp_path / "formats" / "measuring.lock"
    lock.parent.mkdir()
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # another process loading a model
        waiter = threading.Thread(target=lambda: load_model(spec))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not measured
        # and the loading process's own nested loads do not wait on themselves
        with models.machine_turn(exclusive=False):
            assert load_model(dataclasses.replace(spec, dtype="int8")).weight_format == "int8"
    waiter.join(120)
    assert measured == [spec]
