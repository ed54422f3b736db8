"""`pagedllm bench throughput --json-schema`: the flag's three forms, clear errors, and a constrained CPU run whose
outputs have their full length and are a prefix of JSON the default schema accepts."""

from __future__ import annotations

import argparse
import json

import jsonschema
import pytest

from pagedllm.benchmarks import throughput
from pagedllm.benchmarks.throughput import DEFAULT_JSON_SCHEMA, ThroughputResult, load_json_schema
from pagedllm.demo import default_model
from pagedllm.entrypoints.cli import main as cli_main

SMALL_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench throughput")
    throughput.add_cli_args(parser)
    return parser


def test_json_schema_flag_takes_default_a_file_or_text(tmp_path) -> None:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SMALL_SCHEMA))
    parser = _parser()
    assert parser.parse_args([]).json_schema is None
    for value, name, schema in [
        ("default", "default", DEFAULT_JSON_SCHEMA),
        (str(path), str(path), SMALL_SCHEMA),
        (json.dumps(SMALL_SCHEMA), "custom", SMALL_SCHEMA),
    ]:
        # The value is kept as given (so --output-json's args show it); load_json_schema resolves it.
        assert parser.parse_args(["--json-schema", value]).json_schema == value
        assert load_json_schema(value) == (name, schema)


@pytest.mark.parametrize(
    "value, why",
    [
        ('{"type": "foo"}', "cannot be enforced by constrained decoding"),  # JSON, not a schema
        ('{"type": ', "not valid JSON"),
        ("[1, 2]", "is not 'default'"),
        ("defualt", "is not 'default'"),
        ("missing.json", "is not 'default'"),
    ],
)
def test_a_bad_json_schema_is_a_usage_error(value: str, why: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "throughput", "--json-schema", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --json-schema:" in err and why in err
    with pytest.raises(ValueError, match="^--json-schema: "):
        load_json_schema(value)


def test_a_json_file_that_is_not_json(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"^--json-schema: the file {path} is not valid JSON"):
        load_json_schema(str(path))


def _complete_records(text: str) -> tuple[list, str]:
    """The complete records at the start of ``text`` (a JSON array cut short), and what follows the last one."""
    assert text.startswith("["), text
    decoder, pos, records = json.JSONDecoder(), 1, []
    while True:
        rest = text[pos:].lstrip()
        if records:
            if not rest.startswith(","):
                break
            rest = rest[1:].lstrip()
        try:
            record, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            break
        records.append(record)
        pos = len(text) - len(rest) + end
    return records, text[pos:]


def test_default_schema_run_gives_full_length_json_prefixes() -> None:
    output_len = 96
    args = _parser().parse_args(
        f"--device cpu --dtype float32 --num-prompts 4 --input-len 16 --output-len {output_len} --temperature 0 "
        "--json-schema default".split()
        + ["--model", default_model()]
    )
    result, outs = throughput.run_pagedllm_outputs(args, args.temperature)
    assert result.structured_outputs == "json schema default"
    assert result.num_output_tokens == 4 * output_len
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model())
    num_records = 0
    for out in outs:
        (c,) = out.outputs
        assert len(c.token_ids) == output_len and c.finish_reason == "length"
        text = tok.decode(c.token_ids)
        assert "".join(text.split()).startswith('[{"id":'), text
        records, rest = _complete_records(text)
        for record in records:
            jsonschema.validate(record, DEFAULT_JSON_SCHEMA["items"])
        assert not rest.strip() or rest.lstrip()[0] in ",{", text  # the next record, cut short
        num_records += len(records)
    assert num_records >= 1  # at least one record completed somewhere, and it was valid


def test_main_reports_the_constraint(monkeypatch, tmp_path, capsys) -> None:
    out = tmp_path / "result.json"
    args = _parser().parse_args(["--json-schema", "default", "--output-json", str(out)])
    canned = ThroughputResult("pagedllm", 2, 1.0, 2.0, 20.0, 16.0, 4, 16, "json schema default")
    monkeypatch.setattr(throughput, "run_pagedllm", lambda args, temperature: canned)
    assert throughput.main(args) == 0
    assert "Throughput (pagedllm, json schema default): " in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["structured_outputs"] == "json schema default" and saved["args"]["json_schema"] == "default"


def test_json_schema_needs_the_pagedllm_backend(capsys) -> None:
    args = _parser().parse_args(["--backend", "hf", "--json-schema", "default"])
    assert throughput.main(args) == 2
    assert "--json-schema needs --backend pagedllm" in capsys.readouterr().err
