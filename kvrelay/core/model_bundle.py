"""The files a producer needs to serve requests for a model, as one content-addressed bundle.

A worker publishes its model's tokenizer files (tokenizer.json, tokenizer_config.json, the chat
template, generation_config.json, config.json: `TOKENIZER_FILES`) under their digest
(`Keys.model_files`), so a producer on any host tokenizes exactly as the worker's own tokenizer
does without the model on disk. The digest names the contents: a producer fetches a bundle
once and may keep it (`write_dir`) for as long as it likes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvrelay.core.record import as_str
from kvrelay.core.tokenizer import TOKENIZER_FILES, Tokenizer, read_tokenizer_files

# A model's files and its `models` entry outlive every worker of the model this long: producers
# that cached the files do not care, new ones need a worker anyway; old versions of a model's
# files do not pile up in Valkey, and a model no worker has served for this long is no longer
# listed (the entry carries `published`, the time of its last heartbeat).
PUBLICATION_TTL_S = 7 * 86400


def bundle_digest(files: Mapping[str, bytes]) -> str:
    """Hex blake2b over the files' names and contents, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(files):
        data = files[name]
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class ModelBundle:
    """A model's tokenizer files (name -> bytes) and their digest."""

    files: Mapping[str, bytes]
    digest: str

    @classmethod
    def of(cls, files: Mapping[str, bytes]) -> ModelBundle:
        """A bundle of `files` (only `TOKENIZER_FILES` names; tokenizer.json required)."""
        unknown = sorted(set(files) - set(TOKENIZER_FILES))
        if unknown:
            raise ValueError(f"not a tokenizer file: {', '.join(unknown)}")
        if "tokenizer.json" not in files:
            raise ValueError("a model bundle needs tokenizer.json")
        files = {name: bytes(data) for name, data in files.items()}
        return cls(files, bundle_digest(files))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> ModelBundle:
        """The bundle of a model directory (the converted one, or a copy from `write_dir`)."""
        return cls.of(read_tokenizer_files(directory))

    @classmethod
    def from_fields(cls, fields: Mapping[bytes | str, bytes], digest: str) -> ModelBundle:
        """A bundle read back from its Redis hash; ValueError unless it is whole and intact."""
        bundle = cls.of({as_str(name): data for name, data in fields.items()})
        if bundle.digest != digest:
            raise ValueError(f"model files {digest} do not match their digest ({bundle.digest})")
        return bundle

    def with_chat_template(self, chat_template: str) -> ModelBundle:
        """This bundle with `chat_template` as the model's (chat_template.jinja wins over a
        template in the other files, as `Tokenizer.from_files` reads them)."""
        return ModelBundle.of({**self.files, "chat_template.jinja": chat_template.encode()})

    def json_file(self, name: str) -> dict:
        """One of the JSON files (config.json, generation_config.json, ...); {} when absent."""
        raw = self.files.get(name)
        data = json.loads(raw) if raw is not None else {}
        return data if isinstance(data, dict) else {}

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_files(self.files)

    def write_dir(self, directory: str | os.PathLike) -> Path:
        """Write the files into `directory` (created whole: a temp dir renamed into place)."""
        target = Path(directory)
        if target.is_dir():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            for name, data in self.files.items():
                (tmp / name).write_bytes(data)
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not target.is_dir():  # not another process winning the rename
                raise
        return target
