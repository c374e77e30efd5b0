"""Cold layers read by GPUDirect Storage (kvikio): from their files straight into VRAM slots,
no host staging. Used when the nvidia-fs driver is loaded and kvikio imports (what `nerva
topology` checks); otherwise the cuda engine stages cold reads through pinned RAM, and says so."""

from __future__ import annotations

import os

from nerva_cli.errors import BadInput


def status() -> dict:
    """{"used": bool, "reason": str}, from the same check `nerva topology` reports."""
    from nerva_cli.hardware.topology import gpudirect_storage

    g = gpudirect_storage()
    return {"used": g["available"], "reason": g["reason"]}


class GdsReader:
    """Whole layer files into device buffers. Each file is verified once here (size, sha256);
    afterwards every read checks that its size and identity (mtime, inode) are unchanged, so a
    file rewritten after load stops the run naming it, as the pager's reads do."""

    def __init__(self, model, fnames: list[str]):
        import kvikio

        self.kvikio, self.model = kvikio, model
        self.identity = {}
        for fname in fnames:
            model.read_bytes(fname)  # size and sha256 against metadata.json
            self.identity[fname] = self._identity(fname)

    def _identity(self, fname: str) -> tuple:
        st = os.stat(self.model.path / fname)
        return st.st_size, st.st_mtime_ns, st.st_ino

    def read(self, fname: str, dst) -> int:
        """The whole file into the device buffer dst (at least the file's size); -> bytes read."""
        path = self.model.path / fname
        if self._identity(fname) != self.identity[fname]:
            raise BadInput(f"{path}: changed on disk since it was verified")
        size = self.model.meta["files"][fname]["size"]
        with self.kvikio.CuFile(str(path), "r") as f:
            got = f.pread(dst[:size], size, 0).get()
        if got != size:
            raise BadInput(f"{path}: short read ({got} of {size} bytes)")
        return got
