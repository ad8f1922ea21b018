"""Applies run-time LoRA commands (`core.lora_command`) to a worker's engine.

A command's lifecycle here: the ingress writes it into the pipeline's `loras` hash -> this
thread's next poll (every POLL_S; the first one before the worker reads any task) finds an id
it has not applied -> the adapter is loaded (or unloaded) beside the compute loop, which sees
the engine's adapters swap in one assignment -> the model's publication is rewritten with the
adapters now held -> the worker's result goes into `lora-result:{id}` ("" done, else why not),
which the ingress waits for.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import redis

from kvrelay.core.keys import Keys
from kvrelay.core.lora_command import RESULT_TTL_S, LoraCommand, LoraOp
from kvrelay.core.messages import MessageError
from kvrelay.workers.errors import LoraError
from kvrelay.workers.model.lora import LoraSet
from kvrelay.workers.publication import ModelPublication

logger = logging.getLogger(__name__)

POLL_S = 0.25


def published_loras(loras: LoraSet) -> dict[str, str] | None:
    """The `loras` field of the model's `models` entry: adapter name -> its page identity."""
    return {name: loras.get(name).salt for name in loras.names()} or None


class LoraControl:
    """Polls `keys.loras` and applies each new command to `loras` (worker `name`)."""

    def __init__(
        self,
        r: redis.Redis | redis.RedisCluster,
        keys: Keys,
        name: str,
        loras: LoraSet,
        publication: ModelPublication | None,
        stop: threading.Event,
    ):
        self.r, self.keys, self.name, self.loras = r, keys, name, loras
        self.publication, self.stop = publication, stop
        self._applied: set[str] = set()
        self.thread = threading.Thread(target=self._run, name="lora-control", daemon=True)

    def poll(self) -> int:
        """Apply the commands not applied yet; how many were (raises on Redis errors)."""
        raw = self.r.hgetall(self.keys.loras)
        applied = 0
        for value in raw.values():
            payload = value if isinstance(value, bytes) else str(value).encode()
            try:
                command = LoraCommand.decode(payload)
            except MessageError as exc:
                logger.warning("ignoring an unreadable LoRA command: %s", exc)
                continue
            if command.id in self._applied:
                continue
            error = self._apply(command)
            self._applied.add(command.id)
            applied += 1
            if self.publication is not None:  # before the result: a reader sees it served
                loras = published_loras(self.loras)
                self.publication.entry = replace(self.publication.entry, loras=loras)
                self.publication.publish(self.r, self.keys)
            key = self.keys.lora_result(command.id)
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(key, self.name, error)
            pipe.expire(key, RESULT_TTL_S)
            pipe.execute()
        return applied

    def _apply(self, command: LoraCommand) -> str:
        """ "" once applied, else why not."""
        try:
            if command.op == LoraOp.LOAD:
                self.loras.load(command.name, command.path)
            elif command.name in self.loras:
                self.loras.unload(command.name)
            else:  # never loaded here: nothing to undo
                logger.info("LoRA adapter %s: unload of an adapter not held", command.name)
                return ""
        except LoraError as exc:
            logger.warning("LoRA command %s (%s %s) failed: %s", command.id, command.op,
                           command.name, exc)  # fmt: skip
            return str(exc)
        logger.info("LoRA adapter %s: %sed (command %s)", command.name, command.op, command.id)
        return ""

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(POLL_S):
            try:
                self.poll()
            except redis.RedisError as exc:
                logger.warning("LoRA commands unread: %s", exc)
            except Exception:  # a bug here must not end the polling
                logger.exception("applying LoRA commands failed")
