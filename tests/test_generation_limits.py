"""One validator for the generation options, and every way in refusing with its own names."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from edgemm.cli.main import main
from edgemm.config import config_from_dict
from edgemm.errors import ConfigError, InputError
from edgemm.engine.generate import GenerationOptions, sample_token
from edgemm.util.errors import LimitError
from edgemm.util.generation_limits import MAX_BEAMS, MAX_NEW_TOKENS, MAX_SEED, MIN_TEMPERATURE, check_generation
from edgemm.server.errors import ApiError
from edgemm.server.protocol import parse_chat_request
from edgemm.server.inference_routes import infer_query

IMAGE = "data:image/png;base64,iVBORw0KGgo="  # never decoded: the options are refused first


def refusal(**options) -> LimitError:
    with pytest.raises(LimitError) as info:
        check_generation(**options)
    assert "\n" not in str(info.value)
    return info.value


# ---- the validator ----------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"max_new_tokens": 0}, f"'max_new_tokens' must be in 1..{MAX_NEW_TOKENS}, got 0"),
    ({"max_new_tokens": MAX_NEW_TOKENS + 1}, f"'max_new_tokens' must be in 1..{MAX_NEW_TOKENS}, got 4097"),
    ({"max_new_tokens": 2.0}, "'max_new_tokens' must be an integer, got 2.0"),
    ({"max_new_tokens": True}, "'max_new_tokens' must be an integer, got True"),
    ({"temperature": -0.5}, "'temperature' must be >= 0, got -0.5"),
    ({"temperature": 5e-324}, "'temperature' must be 0 (greedy) or at least 0.001, got 5e-324"),
    ({"temperature": math.nan}, "'temperature' must be a finite number, got nan"),
    ({"temperature": math.inf}, "'temperature' must be a finite number, got inf"),
    ({"temperature": "hot"}, "'temperature' must be a number, got 'hot'"),
    ({"top_p": 0.0}, "'top_p' must be in (0, 1], got 0.0"),
    ({"top_p": 1.0000001}, "'top_p' must be in (0, 1], got 1.0000001"),
    ({"top_p": -math.inf}, "'top_p' must be a finite number, got -inf"),
    ({"seed": -1}, "'seed' must be >= 0, got -1"),
    ({"seed": MAX_SEED + 1}, "'seed' must be at most 2**64 - 1, got 18446744073709551616"),
    ({"seed": 1.5}, "'seed' must be an integer, got 1.5"),
    ({"num_beams": 0}, f"'num_beams' must be in 1..{MAX_BEAMS}, got 0"),
    ({"num_beams": MAX_BEAMS + 1}, f"'num_beams' must be in 1..{MAX_BEAMS}, got 17"),
    ({"beam_gate": math.nan}, "'beam_gate' must be a finite number, got nan"),
    ({"beam_gate": 1.5}, "'beam_gate' must be in [0, 1], got 1.5"),
    ({"num_beams": 2, "temperature": 0.7},
     "'num_beams' must be 1 when sampling (beam search is greedy: temperature 0), got 2"),
])
def test_out_of_limits_is_one_line_naming_the_option(options, message):
    error = refusal(**options)
    assert str(error) == message and isinstance(error, InputError)
    assert error.field == ("num_beams" if len(options) > 1 else next(iter(options)))


def test_the_edges_are_accepted():
    check_generation(max_new_tokens=1, temperature=0, top_p=1, seed=0, num_beams=1, beam_gate=0)
    check_generation(max_new_tokens=MAX_NEW_TOKENS, temperature=MIN_TEMPERATURE, top_p=1e-9, seed=MAX_SEED,
                     beam_gate=1.0)
    check_generation(num_beams=MAX_BEAMS, temperature=0.0, seed=np.uint64(MAX_SEED))  # numpy ints are integers
    check_generation()  # nothing given, nothing to check


def test_names_and_nullable_are_the_callers():
    error = refusal(seed=-1, names={"seed": "generation.seed"}, nullable=("seed",))
    assert str(error) == "'generation.seed' must be >= 0 or null, got -1" and error.field == "generation.seed"


def test_the_smallest_temperature_still_samples():
    """Why the floor: below it ordinary logits over the temperature overflow into NaN."""
    logits = np.array([30.0, 29.0, -30.0], np.float32)
    with np.errstate(all="ignore"):
        z = logits.astype(np.float64) / 5e-324
        assert np.isnan(np.exp(z - z.max())).any()  # what 5e-324 would have done
    rng = np.random.default_rng(0)
    assert sample_token(logits, GenerationOptions(temperature=MIN_TEMPERATURE), rng) == 0


def test_generation_options_use_it():
    for bad in ({"temperature": 1e-300}, {"seed": MAX_SEED + 1}, {"max_new_tokens": 10_000}, {"top_p": math.nan}):
        with pytest.raises(LimitError, match=f"'{next(iter(bad))}' must"):
            GenerationOptions(**bad)
    assert GenerationOptions(temperature=0.5, seed=MAX_SEED).seed == MAX_SEED


# ---- the API: 400 with `param` naming the field as the client wrote it -------------------

def chat_body(**fields) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]}],
            **fields}


@pytest.mark.parametrize("fields, param, message", [
    ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be in 1..4096, got 0"),
    ({"max_completion_tokens": 5000, "max_tokens": 2}, "max_completion_tokens",
     "'max_completion_tokens' must be in 1..4096, got 5000"),
    ({"temperature": 1e-300}, "temperature", "'temperature' must be 0 (greedy) or at least 0.001, got 1e-300"),
    ({"top_p": 0}, "top_p", "'top_p' must be in (0, 1], got 0"),
    ({"seed": 2**64}, "seed", "'seed' must be at most 2**64 - 1, got 18446744073709551616"),
])
def test_api_refuses_with_the_fields_name(fields, param, message):
    with pytest.raises(ApiError) as info:
        parse_chat_request(chat_body(**fields))
    assert (info.value.http_status, info.value.param, str(info.value)) == (400, param, message)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_api_refuses_nan_and_infinity_without_calling_them_not_numbers(literal):
    with pytest.raises(ApiError) as info:  # Python's JSON parser, like the server's, reads these
        parse_chat_request(chat_body(temperature=json.loads(literal)))
    assert info.value.param == "temperature"
    assert "must be a finite number" in str(info.value) and "got a number" not in str(info.value)


def test_infer_query_uses_the_same_limits():
    with pytest.raises(ApiError) as info:
        infer_query({"temperature": "nan"})
    assert info.value.param == "temperature" and "finite" in str(info.value)
    with pytest.raises(ApiError) as info:
        infer_query({"max_tokens": "4097"})
    assert info.value.param == "max_tokens"


# ---- the command line: exit 2 naming the flag, before the model loads ------------------------

@pytest.mark.parametrize("args, flag", [
    (["--max-new-tokens", "0"], "--max-new-tokens"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "1e-9"], "--temperature"), (["--top-p", "1.5"], "--top-p"),
    (["--seed", str(2**64)], "--seed"), (["--beams", "17"], "--beams"), (["--beam-gate", "-1"], "--beam-gate"),
    (["--beams", "2", "--temperature", "0.5"], "--beams"),
])
def test_cli_refuses_with_the_flags_name(args, flag, tmp_path):
    result = CliRunner().invoke(main, ["infer", str(tmp_path / "no-such-image.png"), *args])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"edgemm: error: '{flag}' must ")  # not "no such image": checked first


def test_cli_stream_checks_max_new_tokens():
    result = CliRunner().invoke(main, ["stream", "synthetic://?count=1", "--max-new-tokens", "9999"])
    assert result.exit_code == 2 and "'--max-new-tokens' must be in 1..4096, got 9999" in result.stderr


# ---- the config: ConfigError naming the key path ---------------------------------------------

@pytest.mark.parametrize("data, message", [
    ({"generation": {"temperature": 1e-4}},
     "config: 'generation.temperature' must be 0 (greedy) or at least 0.001, got 0.0001"),
    ({"generation": {"seed": 2**64}}, "config: 'generation.seed' must be at most 2**64 - 1 or null, "
                                      "got 18446744073709551616"),
    ({"generation": {"num_beams": 17}}, "config: 'generation.num_beams' must be in 1..16, got 17"),
    ({"streams": [{"id": "cam", "source": "csi://0", "max_new_tokens": 0}]},
     "config: 'streams[0].max_new_tokens' must be in 1..4096 or null, got 0"),
])
def test_config_refuses_with_the_key_path(data, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value) == message
