"""ContinuousBatchingConfig: transformers' names and defaults, every value checked at construction."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from typing import Any

import pytest

import aiocb
from aiocb.config import ContinuousBatchingConfig
from aiocb.errors import AiocbError, InvalidConfigError

#: transformers' defaults for the fields aiocb shares with its ContinuousBatchingConfig
SEED_DEFAULTS: dict[str, Any] = {
    "page_size": 256,
    "num_blocks": None,
    "max_batch_tokens": None,
    "max_memory_percent": None,
    "max_requests_per_batch": None,
    "max_blocks_per_request": None,
    "allow_block_sharing": True,
    "use_async_batching": None,
    "use_cuda_graph": None,
    "q_padding_interval_size": 0,
    "kv_padding_interval_size": 0,
    "varlen_compile_config": None,
    "decode_compile_config": None,
    "default_compile_level": 0,
    "scheduler_type": "fifo",
    "safety_margin": None,
    "return_logprobs": False,
    "seed": None,
    "auto_switch_to_flash": True,
    "cpu_offload_space": 0.0,
    "cpu_offload_space_safety_threshold": 0.8,
    "cpu_group_timeout": 300.0,
    "per_request_processors": False,
    "max_queue_size": 0,
    "drop_unsupported_processors": True,
    "disable_nccl_graph_mixing": True,
    "block_size": None,
    "use_default_compile_configs": None,
    "max_cached_graphs": None,
}


def test_defaults_follow_the_seed() -> None:
    config = ContinuousBatchingConfig()
    values = dataclasses.asdict(config)
    for name, default in SEED_DEFAULTS.items():
        assert values[name] == default, name
        assert type(values[name]) is type(default), name
    # the fields aiocb adds
    assert set(values) == {*SEED_DEFAULTS, "max_queued_tokens", "max_model_len", "grammar_compile_timeout"}
    assert config.max_queued_tokens == 0 and config.max_model_len is None and config.grammar_compile_timeout == 10.0


def test_shared_defaults_equal_transformers_own() -> None:
    from transformers import ContinuousBatchingConfig as SeedConfig

    seed_defaults = {
        name: p.default
        for name, p in inspect.signature(SeedConfig.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    shared = set(SEED_DEFAULTS) & set(seed_defaults)
    assert len(shared) >= 20  # the names are transformers' names
    for name in shared:
        assert getattr(ContinuousBatchingConfig(), name) == seed_defaults[name], name


@pytest.mark.parametrize("graphs", [None, True, False, (False, True), (True, False)])
def test_the_seeds_derived_properties_say_what_transformers_own_say(graphs: Any) -> None:
    from transformers import ContinuousBatchingConfig as SeedConfig

    ours, theirs = ContinuousBatchingConfig(use_cuda_graph=graphs), SeedConfig(use_cuda_graph=graphs)
    assert ours.cuda_graph_booleans == theirs.cuda_graph_booleans
    assert ours.fallback_max_blocks_per_request == theirs.fallback_max_blocks_per_request == 32


def test_block_size_is_the_deprecated_name_of_page_size() -> None:
    config = ContinuousBatchingConfig(block_size=32)
    assert config.page_size == 32
    assert config.block_size is None
    with pytest.raises(ValueError, match="page_size"):
        ContinuousBatchingConfig(block_size=2)
    with pytest.raises(ValueError, match=r"page_size=64 and block_size=32 \(its deprecated name\) disagree"):
        ContinuousBatchingConfig(page_size=64, block_size=32)
    assert ContinuousBatchingConfig(page_size=32, block_size=32).page_size == 32


def test_a_compile_mode_or_backend_torch_lacks_is_refused_when_the_config_is_made() -> None:
    with pytest.raises(ValueError, match="decode_compile_config's mode must be one of default"):
        ContinuousBatchingConfig(decode_compile_config={"mode": "bogus"})
    with pytest.raises(ValueError, match="varlen_compile_config's backend must be one of"):
        ContinuousBatchingConfig(varlen_compile_config={"backend": "nonexistent"})
    ContinuousBatchingConfig(decode_compile_config={"mode": "max-autotune-no-cudagraphs", "backend": "inductor"})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"fullgraph": True}, "fullgraph must be false: aiocb's paged attention runs outside the compiled graph"),
        ({"fullgraph": "no"}, "fullgraph must be a bool, got 'no'"),
        ({"dynamic": "yes"}, "dynamic must be a bool or None, got 'yes'"),
        ({"disable": 1}, "disable must be a bool, got 1"),
        ({"options": 5}, "options must be a dict or None, got 5"),
        ({"backend": 5}, "backend must be a backend's name or a callable, got 5"),
    ],
)
def test_compile_arguments_of_the_wrong_kind_are_refused_naming_them(arguments: dict[str, Any], message: str) -> None:
    """Each failed only once the model ran (fullgraph killed the engine at its first step,
    blaming the model), or as the engine started, in torch's words."""
    for name in ("varlen_compile_config", "decode_compile_config"):
        with pytest.raises(InvalidConfigError, match=f"{name}'s {message}"):
            ContinuousBatchingConfig(**{name: arguments})


async def test_a_compile_backend_s_failure_is_reported_in_its_own_words() -> None:
    """torch.compile failing at the first step is not the model's failure (it was blamed:
    "the model is not supported")."""
    from tests.conftest import tiny_llama

    def broken(graph: Any, inputs: Any) -> Any:
        raise RuntimeError("this backend fails")

    config = ContinuousBatchingConfig(page_size=16, num_blocks=16, varlen_compile_config={"backend": broken})
    async with aiocb.Manager(tiny_llama(), continuous_batching_config=config) as manager:
        with pytest.raises(aiocb.EngineDeadError, match="BackendCompilerFailed") as failed:
            await manager.generate([1, 2, 3], max_new_tokens=2)
    assert "not supported" not in str(failed.value)


def test_the_config_is_exported() -> None:
    assert aiocb.ContinuousBatchingConfig is ContinuousBatchingConfig


def test_invalid_config_error_is_a_value_error() -> None:
    assert issubclass(InvalidConfigError, ValueError)
    assert issubclass(InvalidConfigError, AiocbError)


# ---------------------------------------------------------------------- page_size


@pytest.mark.parametrize("page_size", [3, 1, 0, -16])
def test_page_size_below_four_raises_value_error(page_size: int) -> None:
    with pytest.raises(ValueError, match="page_size") as info:
        ContinuousBatchingConfig(page_size=page_size)
    assert isinstance(info.value, InvalidConfigError)


@pytest.mark.parametrize("page_size", [4, 16, 256, 1024])
def test_page_size_of_four_or_more_is_accepted(page_size: int) -> None:
    assert ContinuousBatchingConfig(page_size=page_size).page_size == page_size


@pytest.mark.parametrize("page_size", [True, 16.0, "16", None])
def test_page_size_must_be_an_int(page_size: Any) -> None:
    with pytest.raises(InvalidConfigError, match="page_size must be an int"):
        ContinuousBatchingConfig(page_size=page_size)


def test_positional_page_size_is_checked_too() -> None:
    assert ContinuousBatchingConfig(64).page_size == 64
    with pytest.raises(InvalidConfigError, match="page_size"):
        ContinuousBatchingConfig(2)


# ---------------------------------------------------------------------- unknown fields


def test_unknown_field_raises_naming_it() -> None:
    with pytest.raises(InvalidConfigError, match=r"unknown ContinuousBatchingConfig field\(s\): pagesize;"):
        ContinuousBatchingConfig(pagesize=16)


def test_several_unknown_fields_are_all_named() -> None:
    with pytest.raises(InvalidConfigError, match=r"field\(s\): blocksize, max_tokens;") as info:
        ContinuousBatchingConfig(page_size=16, max_tokens=3, blocksize=32)
    assert "page_size" in str(info.value)  # the message lists the known fields


def test_from_dict() -> None:
    config = ContinuousBatchingConfig.from_dict({"page_size": 32, "scheduler_type": "prefill_first"})
    assert (config.page_size, config.scheduler_type) == (32, "prefill_first")
    with pytest.raises(InvalidConfigError, match=r"field\(s\): typo;"):
        ContinuousBatchingConfig.from_dict({"typo": 1})
    with pytest.raises(InvalidConfigError, match="page_size"):
        ContinuousBatchingConfig.from_dict({"page_size": 1})


def test_replace_validates_and_copies() -> None:
    config = ContinuousBatchingConfig(page_size=32)
    other = config.replace(num_blocks=100)
    assert other.num_blocks == 100
    assert other.page_size == 32
    assert config.num_blocks is None
    with pytest.raises(InvalidConfigError, match="page_size"):
        config.replace(page_size=2)
    with pytest.raises(InvalidConfigError, match=r"field\(s\): nope;"):
        config.replace(nope=1)


# ---------------------------------------------------------------------- scheduler, margin


@pytest.mark.parametrize("scheduler_type", ["lifo", "FIFO", "", None, "prefill-first"])
def test_bad_scheduler_type(scheduler_type: Any) -> None:
    with pytest.raises(InvalidConfigError, match=r"scheduler_type must be one of \['fifo', 'prefill_first'\]"):
        ContinuousBatchingConfig(scheduler_type=scheduler_type)


@pytest.mark.parametrize("margin", [-0.01, 1.01, 2.0, -1.0])
def test_safety_margin_out_of_range(margin: float) -> None:
    with pytest.raises(InvalidConfigError, match="safety_margin must be in"):
        ContinuousBatchingConfig(safety_margin=margin)


@pytest.mark.parametrize("margin", [0.0, 0.3, 1.0])
def test_safety_margin_in_range(margin: float) -> None:
    assert ContinuousBatchingConfig(safety_margin=margin).resolved_safety_margin == margin
    config = ContinuousBatchingConfig(scheduler_type="prefill_first", safety_margin=margin)
    assert config.resolved_safety_margin == margin


def test_resolved_safety_margin_defaults_per_scheduler() -> None:
    assert ContinuousBatchingConfig().resolved_safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="fifo").resolved_safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").resolved_safety_margin == 0.0
    assert ContinuousBatchingConfig().safety_margin is None  # the field itself stays unset


# ---------------------------------------------------------------------- other values


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_blocks", 0),
        ("num_blocks", -1),
        ("max_batch_tokens", 0),
        ("max_batch_tokens", -8),
        ("max_requests_per_batch", 0),
        ("max_requests_per_batch", -1),
        ("max_blocks_per_request", -1),
        ("q_padding_interval_size", -1),
        ("kv_padding_interval_size", -1),
        ("max_queue_size", -1),
        ("max_queued_tokens", -1),
        ("default_compile_level", -1),
    ],
)
def test_negative_or_zero_counts_raise(field: str, value: int) -> None:
    with pytest.raises(InvalidConfigError, match=f"{field} must be >= "):
        ContinuousBatchingConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_blocks", 1),
        ("max_batch_tokens", 1),
        ("max_requests_per_batch", 1),
        ("max_blocks_per_request", 0),  # 0 turns the decode fast path off
        ("q_padding_interval_size", 0),
        ("kv_padding_interval_size", 128),
        ("max_queue_size", 0),
        ("max_queued_tokens", 10_000),
        ("default_compile_level", 3),
        ("max_memory_percent", 1.0),
        ("max_memory_percent", 0.05),
        ("cpu_offload_space", None),
        ("cpu_offload_space", 2.5),
        ("cpu_offload_space_safety_threshold", 1.0),
        ("cpu_offload_space_safety_threshold", 0.0),
        ("cpu_group_timeout", None),
        ("cpu_group_timeout", 0.5),
        ("grammar_compile_timeout", None),
        ("grammar_compile_timeout", 0.25),
        ("seed", 0),
        ("seed", 2**40),
        ("use_cuda_graph", True),
        ("use_cuda_graph", (True, False)),
        ("varlen_compile_config", {"mode": "max-autotune"}),
        ("decode_compile_config", {}),
    ],
)
def test_edge_values_are_accepted(field: str, value: Any) -> None:
    assert getattr(ContinuousBatchingConfig(**{field: value}), field) == value


def test_a_cuda_graph_pair_read_from_json_is_taken() -> None:
    assert ContinuousBatchingConfig(use_cuda_graph=[True, False]).use_cuda_graph == (True, False)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_blocks", 1.5, "num_blocks must be an int"),
        ("max_batch_tokens", "8192", "max_batch_tokens must be an int"),
        ("max_requests_per_batch", True, "max_requests_per_batch must be an int"),
        ("default_compile_level", 4, "default_compile_level must be 0, 1, 2 or 3"),
        ("max_memory_percent", 0.0, "max_memory_percent must be in"),
        ("max_memory_percent", 1.5, "max_memory_percent must be in"),
        ("max_memory_percent", -0.2, "max_memory_percent must be in"),
        ("cpu_offload_space", -1.0, "cpu_offload_space must be >= 0"),
        ("cpu_offload_space_safety_threshold", -0.1, "cpu_offload_space_safety_threshold must be in"),
        ("cpu_offload_space_safety_threshold", 1.2, "cpu_offload_space_safety_threshold must be in"),
        ("cpu_group_timeout", 0, "cpu_group_timeout must be > 0"),
        ("cpu_group_timeout", -5.0, "cpu_group_timeout must be > 0"),
        ("grammar_compile_timeout", 0, "grammar_compile_timeout must be > 0"),
        ("seed", True, "seed must be an int"),
        ("seed", 1.0, "seed must be an int"),
        ("seed", "7", "seed must be an int"),
        ("use_cuda_graph", "yes", "use_cuda_graph must be"),
        ("use_cuda_graph", (True,), "use_cuda_graph must be"),
        ("use_cuda_graph", (True, 1), "use_cuda_graph must be"),
        ("use_cuda_graph", [True, 1], "use_cuda_graph must be"),
        ("use_cuda_graph", [True], "use_cuda_graph must be"),
        ("decode_compile_config", {"mdoe": "reduce-overhead"}, "'mdoe', which torch.compile does not take"),
        ("varlen_compile_config", ["mode"], "varlen_compile_config must be a dict"),
        ("decode_compile_config", "max-autotune", "decode_compile_config must be a dict"),
    ],
)
def test_invalid_values_raise(field: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        ContinuousBatchingConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("allow_block_sharing", "no"),
        ("drop_unsupported_processors", "no"),
        ("return_logprobs", 3),
        ("use_async_batching", "yes"),
        ("disable_nccl_graph_mixing", 0),
        ("max_memory_percent", "0.5"),
        ("safety_margin", "0.1"),
        ("cpu_offload_space", float("nan")),
        ("cpu_offload_space", float("inf")),
        ("cpu_offload_space_safety_threshold", None),
        ("cpu_group_timeout", float("nan")),
        ("grammar_compile_timeout", float("inf")),
        ("grammar_compile_timeout", "10"),
        ("scheduler_type", ["fifo"]),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_by_name(field: str, value: Any) -> None:
    """Never stored to act otherwise later ("no" is true), nor a bare TypeError or a failure
    at start()."""
    with pytest.raises(aiocb.InvalidConfigError, match=field):
        aiocb.ContinuousBatchingConfig(**{field: value})


@pytest.mark.parametrize(("given", "level"), [(True, 3), (False, 0)])
def test_use_default_compile_configs_sets_the_compile_level_as_transformers_does(
    given: bool, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="aiocb.config"):
        config = aiocb.ContinuousBatchingConfig(use_default_compile_configs=given, default_compile_level=1)
    assert config.default_compile_level == level
    assert "use_default_compile_configs is deprecated" in caplog.text


def test_a_transformers_compile_config_is_taken_as_its_torch_compile_arguments() -> None:
    from transformers import CompileConfig

    config = ContinuousBatchingConfig(decode_compile_config=CompileConfig(mode="max-autotune", dynamic=False))
    assert config.decode_compile_config == {
        "fullgraph": False,
        "dynamic": False,
        "backend": "inductor",
        "mode": "max-autotune",
        "options": None,
    }
    with pytest.raises(InvalidConfigError, match="varlen_compile_config"):
        ContinuousBatchingConfig(varlen_compile_config="max-autotune")  # type: ignore[arg-type]


async def test_transformers_own_config_is_taken_field_by_field(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import ContinuousBatchingConfig as TransformersConfig
    from transformers import GenerationConfig

    from tests.conftest import random_prompts, reference_generate, tiny_qwen3

    model = tiny_qwen3()
    prompt = random_prompts(1, 12, 12, seed=3)[0]
    theirs = TransformersConfig(page_size=16, num_blocks=40, max_batch_tokens=128)
    async with aiocb.Manager(model, continuous_batching_config=theirs) as manager:
        assert isinstance(manager.config, ContinuousBatchingConfig)
        assert (manager.config.page_size, manager.config.num_blocks) == (16, 40)
        output = await manager.generate(prompt, max_new_tokens=4)
        assert manager.statistics().total_blocks == 40
    assert output.generated_tokens == reference_generate(model, prompt, 4)
    # Carried by a GenerationConfig (deprecated in transformers, still honoured there): taken, with a warning.
    with pytest.warns(FutureWarning, match="deprecated"):  # (transformers' own warning)
        carrier = GenerationConfig(max_new_tokens=3, continuous_batching_config=theirs)
    with caplog.at_level("WARNING", logger="aiocb.config"):
        async with aiocb.Manager(model, carrier) as manager:
            output = await manager.generate(prompt)
            assert manager.statistics().total_blocks == 40
    assert caplog.text.count("through GenerationConfig is deprecated") == 1
    assert output.generated_tokens == reference_generate(model, prompt, 3)
    caplog.clear()
    with caplog.at_level("WARNING", logger="aiocb.config"):
        await asyncio.to_thread(aiocb.generate_batch, model, [prompt], carrier)
    assert caplog.text.count("through GenerationConfig is deprecated") == 1  # (once a call, not twice)
    with pytest.raises(InvalidConfigError, match=r"must be an aiocb\.ContinuousBatchingConfig .* got dict"):
        aiocb.Manager(model, continuous_batching_config={"page_size": 16})  # type: ignore[arg-type]


async def test_the_sizes_a_manager_chose_are_in_its_continuous_batching_config() -> None:
    from tests.conftest import tiny_qwen3

    config = ContinuousBatchingConfig(page_size=16, max_memory_percent=0.01)
    manager = aiocb.Manager(tiny_qwen3(), continuous_batching_config=config)
    assert manager.continuous_batching_config is manager.config  # (nothing chosen yet)
    async with manager:
        chosen = manager.continuous_batching_config
        assert chosen.num_blocks == manager.statistics().total_blocks > 0
        assert chosen.max_batch_tokens is not None and chosen.max_requests_per_batch is not None
        assert (chosen.page_size, chosen.max_memory_percent) == (16, 0.01)
        # (what it runs with on a CPU: no graphs, synchronous steps, 32-block tables)
        assert (chosen.use_cuda_graph, chosen.use_async_batching, chosen.max_blocks_per_request) == (
            (False, False),
            False,
            32,
        )
    assert config.num_blocks is None and manager.config is config  # (the given one is left as it was)
    await manager.destroy()
    async with aiocb.Manager(tiny_qwen3(), continuous_batching_config=ContinuousBatchingConfig()) as manager:
        chosen = manager.continuous_batching_config
    assert chosen.max_memory_percent == 0.6  # (the CPU's default share)
    async with aiocb.Manager(
        tiny_qwen3(), continuous_batching_config=ContinuousBatchingConfig(use_async_batching=True)
    ) as manager:
        assert manager.continuous_batching_config.use_async_batching is True


def test_padding_intervals_say_they_have_no_effect(caplog: pytest.LogCaptureFixture) -> None:
    """transformers pads its graphs of mixed steps by them; aiocb captures none: a value
    other than 0 is taken with a warning naming it, not silently."""
    with caplog.at_level(logging.WARNING, logger="aiocb.config"):
        ContinuousBatchingConfig()
        assert not caplog.records
        ContinuousBatchingConfig(kv_padding_interval_size=128)
    assert [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()] == [
        "ContinuousBatchingConfig.kv_padding_interval_size pads transformers' CUDA graphs of mixed steps, which "
        "aiocb does not capture: it has no effect (aiocb's decode graphs are keyed by padded batch size)"
    ]
