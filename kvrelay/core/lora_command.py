"""Run-time LoRA adapter commands: the ingress writes one per adapter name into the pipeline's
`loras` hash (`Keys.loras`), every worker of the pipeline applies each command once and says
how it went in `Keys.lora_result(id)` (`kvrelay.workers.lora_control`); a worker that starts
later applies the hash as it finds it, so it holds the adapters its peers hold.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

import msgspec

from kvrelay.core.messages import MAX_LORA_CHARS, Message, NonEmptyStr

RESULT_TTL_S = 600  # a command's results outlive any wait for them
MAX_PATH_CHARS = 4096


class LoraOp(enum.StrEnum):
    LOAD = "load"
    UNLOAD = "unload"


class LoraCommand(Message, tag="lora", kw_only=True):
    """Load adapter `name` from `path` (a PEFT directory on the workers' hosts) or unload it;
    `id` names the command (its results' key)."""

    kind: ClassVar[str] = "lora"
    id: NonEmptyStr
    op: LoraOp
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LORA_CHARS)]
    path: Annotated[str, msgspec.Meta(max_length=MAX_PATH_CHARS)] = ""
