"""A packed model on disk: manifest, config, trunk records, and where each expert file lives."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

from deltafin.errors import DriveError, ExpertFileError, ManifestError
from deltafin.io.schedule import Piece
from deltafin.quant.record import QTensor
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf
from deltafin.store.families import text_config_of


class ExpertFileRef(NamedTuple):
    """One file of an expert: a whole copy (offset 0, the whole file) or one piece of a striped expert."""

    drive: int
    path: str
    offset: int
    nbytes: int


@dataclass
class PackedModel:
    path: str
    doc: dict
    config: dict
    drives: list[mf.DriveEntry]  # with run-time mount points applied
    _stripes: dict = field(default_factory=dict, repr=False)
    _folders: dict = field(default_factory=dict, repr=False)  # (drive, layer) -> resolved expert folder

    _reader: object = field(default=None, repr=False)  # locks.ReaderLock on the layout generation read
    _seen: tuple | None = field(default=None, repr=False)  # the manifest's (inode, size, mtime) when last read

    @classmethod
    def open(cls, path: str, drive_map: dict[str, str] | None = None, only: set[str] | None = None,
             reader: bool = True) -> PackedModel:
        """Open a packed model; ``only``: the drive labels that must be mounted here (a cluster rank's own).
        ``reader``: hold the layout generation's reader lock, so 'deltafin place' waits before deleting
        files this process may still read (writers open with False)."""
        path = os.path.abspath(path)
        doc = mf.load(path)
        from deltafin.store.load_checks import check_against_config, check_distinct_drives, read_config

        config = read_config(path, doc)
        check_against_config(doc, config, os.path.join(path, mf.MANIFEST))
        drives = mf.drives(doc)
        drive_map = drive_map or {}
        unknown = set(drive_map) - {d.label for d in drives}
        if unknown:
            raise ManifestError(f"--drive-map names unknown drive label(s) {sorted(unknown)}; this model's drives "
                                f"are {[d.label for d in drives]}")
        drives = [mf.DriveEntry(d.label, os.path.abspath(drive_map.get(d.label, d.path)), d.gbps, d.measured)
                  for d in drives]
        check_distinct_drives(drives, "--drive-map" if drive_map else os.path.join(path, mf.MANIFEST))
        for d in drives:
            if only is not None and d.label not in only:
                continue
            if not os.path.isdir(os.path.join(d.path, doc["model_id"])):
                raise DriveError(
                    f"drive {d.label}: {d.path} holds no {doc['model_id']}/ folder; is the drive mounted? If it "
                    f"moved, pass --drive-map {d.label}=/new/mount/point"
                )
        pm = cls(path, doc, config, drives)
        pm._seen = _stamp(os.path.join(path, mf.MANIFEST))
        if reader:
            from deltafin.store.locks import ReaderLock

            pm._reader = ReaderLock(path, int(doc.get("generation", 0)))
        return pm

    @property
    def generation(self) -> int:
        return int(self.doc.get("generation", 0))

    def refresh(self) -> bool:
        """Take up a new layout of the same model ('deltafin place' ran): True when the layout changed. Cheap
        when nothing did (one stat). The caller makes sure no read is in flight."""
        stamp = _stamp(os.path.join(self.path, mf.MANIFEST))
        if stamp == self._seen or stamp is None:
            return False
        try:
            doc = mf.load(self.path)
        except ManifestError:
            return False  # mid-rename or damaged: keep the layout in use; /health says what is wrong
        self._seen = stamp
        if int(doc.get("generation", 0)) == self.generation:
            return False
        same = (doc.get("uid") == self.doc.get("uid") and doc["model_id"] == self.model_id
                and doc["experts"]["checksums"] == self.doc["experts"]["checksums"]
                and [d["label"] for d in doc["drives"]] == [d.label for d in self.drives])
        if not same:
            return False  # another model or a repack: a restart takes it up; /health reports it
        self.doc = doc
        self._stripes.clear()
        self._folders.clear()
        if self._reader is not None:
            self._reader.move(self.generation)
        return True

    def health(self, limit: int = 5) -> list[str]:
        """What is wrong with the files this process reads: the manifest gone or replaced, drive folders or
        expert files missing. Empty when all is there."""
        from deltafin.store.health import problems

        return problems(self, limit)

    @property
    def model_id(self) -> str:
        return self.doc["model_id"]

    @property
    def family(self) -> str:
        return self.doc["family"]

    @property
    def text_config(self) -> dict:
        return text_config_of(self.family, self.config)

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

    def stripe(self, layer: int) -> tuple[Piece, ...] | None:
        """The pieces (drive, offset, nbytes) every expert of a striped layer is cut into; None: whole files."""
        if layer not in self._stripes:
            st = (self.doc["experts"].get("stripe") or {}).get(str(layer))
            self._stripes[layer] = None if st is None else tuple(
                Piece(p["drive"], p["offset"], p["nbytes"]) for p in st["pieces"])
        return self._stripes[layer]

    def expert_path(self, layer: int, expert: int, drive: int | None = None) -> str:
        if self.stripe(layer) is not None:
            raise ManifestError(f"layer {layer} of {self.model_id} is striped over drives: expert {expert} has no "
                                f"single file; use expert_files()")
        d = self.locations(layer, expert)[0] if drive is None else drive
        return mf.leaf_under(self.drives[d].path, mf.expert_relpath(self.model_id, layer, expert))

    def piece_path(self, layer: int, expert: int, piece: Piece) -> str:
        rel = mf.piece_relpath(self.model_id, layer, expert, piece.offset, piece.nbytes)
        folder = self._folders.get((piece.drive, layer))
        if folder is None:  # resolved once per drive and layer: the read path asks for every piece
            folder = self._folders[piece.drive, layer] = mf.resolve_under(self.drives[piece.drive].path,
                                                                          os.path.dirname(rel))
        return os.path.join(folder, os.path.basename(rel))

    def expert_files(self, layer: int, expert: int) -> list[ExpertFileRef]:
        """Every file of one expert: its pieces when the layer is striped, else each whole copy."""
        pieces = self.stripe(layer)
        if pieces is not None:
            return [ExpertFileRef(p.drive, self.piece_path(layer, expert, p), p.offset, p.nbytes) for p in pieces]
        n = self.file_bytes(layer)
        return [ExpertFileRef(d, self.expert_path(layer, expert, d), 0, n) for d in self.locations(layer, expert)]

    def read_expert_bytes(self, layer: int, expert: int) -> tuple[bytearray, str]:
        """The whole expert file (pieces put back together), buffered; with a name for messages."""
        files = self.expert_files(layer, expert)
        if self.stripe(layer) is None:
            with open(files[0].path, "rb") as fh:
                return bytearray(fh.read()), files[0].path
        data = bytearray(self.file_bytes(layer))
        for f in files:
            with open(f.path, "rb") as fh:
                got = fh.readinto(memoryview(data)[f.offset : f.offset + f.nbytes])
            if got != f.nbytes:
                raise ExpertFileError(f"{f.path}: truncated ({got} of {f.nbytes} bytes); run 'deltafin verify' and "
                                      f"repack the bad experts")
        return data, f"layer {layer} expert {expert} ({', '.join(f.path for f in files)})"

    def read_expert(self, layer: int, expert: int, verify: bool = True) -> dict[str, QTensor]:
        """Plain buffered read of one expert (tools and tests; the engine reads through io/)."""
        data, where = self.read_expert_bytes(layer, expert)
        if verify:
            ef.check(data, self.checksum(layer, expert), where, "run 'deltafin verify' and repack the bad experts")
        return ef.decode(memoryview(data), where=where)

    def trunk_records(self, progress=None) -> dict[str, QTensor]:
        """Every trunk tensor as a record (int8 stays int8 with its scales); a damaged file is named;
        ``progress(nbytes)`` after each file."""
        from deltafin.store.trunk import load_records

        return load_records(self.path, self.doc, progress)


def _stamp(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
