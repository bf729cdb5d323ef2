"""A packed model on disk: manifest, config, trunk records, and where each expert file lives."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from deltafin.errors import DriveError, ManifestError
from deltafin.quant.record import QTensor
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf


@dataclass
class PackedModel:
    path: str
    doc: dict
    config: dict
    drives: list[mf.DriveEntry]  # with run-time mount points applied

    @classmethod
    def open(cls, path: str, drive_map: dict[str, str] | None = None) -> PackedModel:
        path = os.path.abspath(path)
        doc = mf.load(path)
        cfg_path = mf.resolve_under(path, doc["config"])
        try:
            with open(cfg_path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ManifestError(f"{cfg_path}: cannot read the model config ({e}); repack the model") from e
        drives = mf.drives(doc)
        drive_map = drive_map or {}
        unknown = set(drive_map) - {d.label for d in drives}
        if unknown:
            raise ManifestError(f"--drive-map names unknown drive label(s) {sorted(unknown)}; this model's drives "
                                f"are {[d.label for d in drives]}")
        drives = [mf.DriveEntry(d.label, os.path.abspath(drive_map.get(d.label, d.path)), d.gbps, d.measured)
                  for d in drives]
        for d in drives:
            if not os.path.isdir(os.path.join(d.path, doc["model_id"])):
                raise DriveError(
                    f"drive {d.label}: {d.path} holds no {doc['model_id']}/ folder; is the drive mounted? If it "
                    f"moved, pass --drive-map {d.label}=/new/mount/point"
                )
        return cls(path, doc, config, drives)

    @property
    def model_id(self) -> str:
        return self.doc["model_id"]

    @property
    def family(self) -> str:
        return self.doc["family"]

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config) if self.family == "kimi_k3" else self.config

    @property
    def moe_layers(self) -> list[int]:
        return list(self.doc["experts"]["layers"])

    @property
    def num_experts(self) -> int:
        return int(self.doc["experts"]["num_experts"])

    def file_bytes(self, layer: int) -> int:
        return int(self.doc["experts"]["layouts"][str(layer)]["file_bytes"])

    def locations(self, layer: int, expert: int) -> list[int]:
        return self.doc["experts"]["locations"][str(layer)][expert]

    def checksum(self, layer: int, expert: int) -> str:
        return self.doc["experts"]["checksums"][str(layer)][expert]

    def expert_path(self, layer: int, expert: int, drive: int | None = None) -> str:
        d = self.locations(layer, expert)[0] if drive is None else drive
        return mf.resolve_under(self.drives[d].path, mf.expert_relpath(self.model_id, layer, expert))

    def read_expert(self, layer: int, expert: int, verify: bool = True) -> dict[str, QTensor]:
        """Plain buffered read of one expert (tools and tests; the engine reads through io/)."""
        p = self.expert_path(layer, expert)
        with open(p, "rb") as f:
            data = f.read()
        if verify:
            ef.check(data, self.checksum(layer, expert), p, "run 'deltafin verify' and repack the bad experts")
        return ef.decode(memoryview(bytearray(data)), where=p)

    def trunk_records(self) -> dict[str, QTensor]:
        """Every trunk tensor as a record (int8 stays int8 with its scales)."""
        from safetensors import safe_open

        tensors = self.doc["trunk"]["tensors"]
        by_file: dict[str, list[str]] = {}
        for name, meta in tensors.items():
            by_file.setdefault(meta["file"], []).append(name)
        out: dict[str, QTensor] = {}
        for rel, names in by_file.items():
            with safe_open(mf.resolve_under(self.path, rel), "pt") as f:
                for name in names:
                    meta = tensors[name]
                    scale = f.get_tensor(name + "#scale") if meta["format"] == "int8" else None
                    out[name] = QTensor(meta["format"], tuple(meta["shape"]), f.get_tensor(name), scale)
        return out
