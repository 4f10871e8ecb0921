"""`data.prepare`: the login node makes the indexed dataset a run trains on, once, before the job starts
(every node then reads it from shared storage; a later run or sweep point finds it and goes straight on)."""

from __future__ import annotations

from hpctrain.config.problems import ConfigError, Problem
from hpctrain.config.schema import DataConfig, DataKind, parse_blend


def prepare_data(data: DataConfig) -> None:
    """Write the dataset `data.blend` names from `data.prepare.inputs` if it is not there; raises ConfigError
    on bad input, or when the tokenizer's vocabulary does not fit `data.vocab_size`."""
    if data.kind != DataKind.indexed or not data.prepare.inputs:
        return
    from hpctrain.data.indexed import exists
    from hpctrain.data.prepare import PrepareError, prepare

    assert data.blend is not None  # data=indexed without a blend is refused before (hpctrain.checks.config)
    ((_, prefix),) = parse_blend(data.blend)
    if exists(prefix):
        return
    p = data.prepare
    # progress on stderr as it goes (a bar on a terminal, else a line every few seconds): this can take minutes
    print(f"data: preparing {prefix} from {', '.join(p.inputs)} (once: a later run finds it)", flush=True)
    try:
        summary = prepare(
            list(p.inputs),
            prefix,
            tokenizer=p.tokenizer,
            vocab_size=p.vocab_size,
            workers=p.workers,
            text_key=p.text_key,
            progress=True,
        )
        print(f"data: prepared {summary}", flush=True)
    except PrepareError as exc:
        raise ConfigError(
            [
                Problem(
                    "data.prepare.inputs",
                    str(exc),
                    "fix the input, or prepare the dataset yourself with python -m hpctrain.data.prepare",
                )
            ]
        ) from exc
    if summary.vocab_size > data.vocab_size:
        raise ConfigError(
            [
                Problem(
                    "data.vocab_size",
                    f"the tokenizer of {prefix} has {summary.vocab_size} tokens, "
                    f"more than data.vocab_size={data.vocab_size}",
                    f"set data.vocab_size={summary.vocab_size} and model.vocab_size>={summary.vocab_size}",
                )
            ]
        )
