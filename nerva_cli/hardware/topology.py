"""What this machine offers the runtime (ARCHITECTURE 13): CPU, RAM, NUMA, the store's disk, GPUs,
GPUDirect Storage, and with probe=True measured bandwidths (cached in $NERVA_HOME/topology.json).
Everything is read or tried here; what could not be verified says why, nothing is guessed from a name."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

from nerva_cli.store import catalog as store
from nerva_cli.hardware.machine import allowed_cpus, cpu_name, physical_cores

SIMD = {"avx2": ("avx2",), "avx512f": ("avx512f",), "vnni": ("avx512_vnni", "avx_vnni"),
        "avx512bf16": ("avx512_bf16",),  # the cpu backend's W4A16 runs bf16 dot products with it
        "amx": ("amx_tile",), "neon": ("asimd", "neon")}
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "32K", "1024K"
CHUNK = 4 << 20  # O_DIRECT reads: 4 MB preadv calls into one aligned buffer


def no(reason: str, **extra) -> dict:
    return {"available": False, "reason": reason, **extra}


def collect(probe: bool) -> dict:
    home = store.store_dir()
    return {"cpu": cpu(), "memory": memory(), "numa_nodes": numa_nodes(), "storage": storage(home),
            "gpus": gpus(), "gpudirect_storage": gpudirect_storage(), "peer_memory": peer_memory(),
            "probe": run_probe(home) if probe else cached_probe(home)}


# -- static facts ------------------------------------------------------------------------------
def cpu() -> dict:
    flags: set[str] = set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86 / ARM
                flags.update(value.split())
        source = "/proc/cpuinfo"
    except OSError as e:
        source = f"not read: {e}"
    return {"model": cpu_name(), "physical_cores": physical_cores(), "logical_cores": os.cpu_count(),
            "usable_logical_cores": len(allowed_cpus()), "flags_source": source,
            "simd": {name: any(f in flags for f in names) for name, names in SIMD.items()},
            "caches": cpu_caches()}


def cpu_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict:
    """cpu0's caches as Linux's sysfs lists them: level, type, size and the cpus sharing each
    (whether a model's layers or a KV cache stay in L2 or L3 decides its kernels' speed)."""
    caches = []
    for d in sorted(root.glob("index[0-9]*"), key=lambda p: int(p.name[5:])):
        try:
            level, kind, size = ((d / f).read_text().strip() for f in ("level", "type", "size"))
            shared = (d / "shared_cpu_list").read_text().strip() if (d / "shared_cpu_list").exists() else None
            size_bytes = int(size[:-1]) * SIZE_UNITS[size[-1]] if size[-1] in SIZE_UNITS else int(size)
        except (OSError, ValueError, IndexError) as e:  # IndexError: an empty size
            return no(f"{d}: {e}", levels=[])
        caches.append({"level": int(level), "type": kind.lower(), "size_bytes": size_bytes, "shared_cpus": shared})
    if not caches:
        return no(f"{root} lists no caches", levels=[])
    return {"available": True, "reason": None, "levels": caches}


def memory() -> dict:
    from nerva_cli.hardware.machine import proc_kb

    return {"total_bytes": proc_kb("/proc/meminfo", "MemTotal"),
            "available_bytes": proc_kb("/proc/meminfo", "MemAvailable")}


def numa_nodes() -> list[dict]:
    nodes = []
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = (d / "cpulist").read_text().strip()
        except OSError:
            cpus = None
        nodes.append({"node": int(d.name[4:]), "cpus": cpus})
    return nodes


def _mount(dev: str) -> tuple[str | None, str | None, str | None]:
    """(mount point, fs type, source) of the mount whose major:minor is dev, from mountinfo."""
    try:
        for line in open("/proc/self/mountinfo"):
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if fields[2] == dev:
                return fields[4], tail[0], tail[1]
    except OSError:
        pass
    return None, None, None


def storage(home: Path) -> dict:
    st = os.stat(home)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    mount_point, fstype, source = _mount(dev)
    usage = shutil.disk_usage(home)
    out = {"path": str(home), "device": dev, "mount_point": mount_point, "fs_type": fstype, "source": source,
           "free_bytes": usage.free, "total_bytes": usage.total, "o_direct": o_direct_works(home)}
    sys_dev = Path(f"/sys/dev/block/{dev}")
    if not sys_dev.exists():
        out.update(disk=None, nvme=no(f"/sys/dev/block/{dev} does not exist (not a block device)"))
        return out
    disk = sys_dev.resolve()
    if (disk / "partition").exists():
        disk = disk.parent
    out["disk"] = disk.name
    try:
        transport = (disk / "device" / "subsystem").resolve().name  # nvme, virtio, scsi...
    except OSError as e:
        transport = None
        out["nvme"] = no(f"{disk}/device/subsystem: {e}")
    if transport is not None:
        out["nvme"] = {"available": transport == "nvme",
                       "reason": f"sysfs: {disk.name}'s device is on the {transport} bus"}
    out["transport"] = transport
    try:
        out["rotational"] = (disk / "queue" / "rotational").read_text().strip() == "1"
    except OSError:
        out["rotational"] = None
    return out


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)  # anonymous mappings are page-aligned, as O_DIRECT needs


def o_direct_works(home: Path) -> dict:
    """Writes 4 KB, reads it back with O_DIRECT into an aligned buffer; True only if the bytes match."""
    if not hasattr(os, "O_DIRECT"):
        return no("this OS has no O_DIRECT")
    path = home / f".odirect-{os.getpid()}"
    data = os.urandom(4096)
    try:
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = _aligned(4096)
            got = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        if got != 4096 or buf[:] != data:
            return no(f"O_DIRECT read returned {got} bytes that do not match what was written")
        return {"available": True, "reason": f"read 4096 bytes back with O_DIRECT in {home}"}
    except OSError as e:
        return no(f"O_DIRECT in {home}: {e.strerror or e}")
    finally:
        path.unlink(missing_ok=True)


def gpus() -> dict:
    from nerva_cli.planes.cuda.launch import import_cupy

    try:
        cupy = import_cupy()
    except ImportError:
        return no("cupy is not installed", devices=[])
    try:
        rt = cupy.cuda.runtime
        n = rt.getDeviceCount()
    except Exception as e:  # noqa: BLE001  (a driver without a device raises its own errors)
        return no(f"no CUDA device ({e})", devices=[])
    if n == 0:
        return no("no CUDA device", devices=[])
    devices = []
    for i in range(n):
        p = rt.getDeviceProperties(i)
        d = {"index": i, "name": p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
             "vram_bytes": p["totalGlobalMem"], "compute_capability": f"{p['major']}.{p['minor']}"}
        try:
            pci = Path("/sys/bus/pci/devices") / rt.deviceGetPCIBusId(i).lower()
            d["pcie"] = {"speed": (pci / "current_link_speed").read_text().strip(),
                         "width": int((pci / "current_link_width").read_text()),
                         "numa_node": int((pci / "numa_node").read_text())}
        except Exception as e:  # noqa: BLE001
            d["pcie"] = no(f"not read from sysfs: {e}")
        devices.append(d)
    return {"available": True, "reason": f"{n} CUDA device(s) answered", "devices": devices}


def gpudirect_storage() -> dict:
    nvidia_fs = Path("/proc/driver/nvidia-fs").exists()
    try:
        import kvikio  # noqa: F401  (importable is what is asked)

        kvikio_ok = True
    except Exception:  # noqa: BLE001
        kvikio_ok = False
    missing = [m for m, ok in (("/proc/driver/nvidia-fs does not exist (nvidia-fs driver not loaded)", nvidia_fs),
                               ("kvikio is not importable", kvikio_ok)) if not ok]
    return {"available": not missing, "reason": "; ".join(missing) or "nvidia-fs loaded and kvikio importable",
            "nvidia_fs": nvidia_fs, "kvikio": kvikio_ok}


def peer_memory() -> dict:
    try:
        loaded = any(line.split()[0] == "nvidia_peermem" for line in open("/proc/modules"))
    except OSError as e:
        return no(f"/proc/modules: {e}")
    return {"available": loaded, "reason": "nvidia_peermem is loaded" if loaded
            else "nvidia_peermem is not in /proc/modules"}


# -- measured ----------------------------------------------------------------------------------
def probe_mb() -> int:
    return int(os.environ.get("NERVA_PROBE_MB", "256"))


def ram_read(mb: int) -> dict:
    import numpy as np

    a = np.ones(mb * (1 << 20) // 4, dtype=np.float32)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return {"available": True, "gb_s": round(a.nbytes / best / 1e9, 3),
            "how": f"numpy sum over a {mb} MB float32 array, best of 3"}


def disk_read(home: Path, mb: int) -> dict:
    check = o_direct_works(home)
    if not check["available"]:
        return no(f"no O_DIRECT, so no SSD figure (a page-cache hit is not a disk read): {check['reason']}")
    path = home / f".probe-{os.getpid()}"
    buf = _aligned(CHUNK)
    size = max(1, mb * (1 << 20) // CHUNK) * CHUNK
    try:
        block = os.urandom(CHUNK)
        with open(path, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        best = float("inf")
        for _ in range(2):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                t = time.perf_counter()
                for off in range(0, size, CHUNK):
                    os.preadv(fd, [buf], off)
                best = min(best, time.perf_counter() - t)
            finally:
                os.close(fd)
    except OSError as e:
        return no(f"O_DIRECT read of a {mb} MB file in {home} failed: {e.strerror or e}")
    finally:
        path.unlink(missing_ok=True)
    return {"available": True, "gb_s": round(size / best / 1e9, 3),
            "how": f"O_DIRECT read of a {size >> 20} MB file in {home}, 4 MB preadv calls into an "
                   "aligned buffer, best of 2"}


def gpu_copies(gpu: dict) -> dict:
    """Pinned H2D and D2H bandwidth of the first GPU, through the cuda backend."""
    if not gpu["available"]:
        return {"h2d_pinned": no(gpu["reason"]), "d2h_pinned": no(gpu["reason"])}
    from nerva_cli.planes.cuda.launch import CupyDevice

    try:
        dev = CupyDevice()
        bw = dev.bandwidths(256 << 20)
    except Exception as e:  # a driver error is a fact to report, not a crash
        return {"h2d_pinned": no(f"probe failed: {e}"), "d2h_pinned": no(f"probe failed: {e}")}
    how = f"256 MB pinned copies on {dev.name}, timed with CUDA events, best of 5"
    return {"h2d_pinned": {"available": True, "gb_s": bw["h2d_pinned"], "how": how},
            "d2h_pinned": {"available": True, "gb_s": bw["d2h_pinned"], "how": how}}


def run_probe(home: Path) -> dict:
    mb = probe_mb()
    gpu = gpus()
    result = {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "ram_read": ram_read(mb), "disk_read_o_direct": disk_read(home, mb), **gpu_copies(gpu)}
    tmp = home / f"topology.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, home / "topology.json")  # a reader never sees half a probe
    return result


def cached_probe(home: Path) -> dict | None:
    try:
        return json.loads((home / "topology.json").read_text())
    except (OSError, ValueError):
        return None


# -- residency plan ----------------------------------------------------------------------------
def plan_report(model, plan, probe: dict | None) -> dict:
    """The plan, the bytes each tier serves per decoded token, and the decode bound from disk reads."""
    files, experts = model.meta["files"], expert_plan(model, plan)
    head = files["lm_head.bin" if "lm_head.bin" in files else "embed.bin"]["size"]
    idle = experts["idle_bytes_per_layer"] if experts else 0  # the experts a token does not run
    host = sum(plan.layer_bytes[i] - (idle if i in model.config.moe_layers else 0) for i in plan.resident_layers) \
        + head + files["final_norm.bin"]["size"]
    paged = plan.paged_bytes_per_token
    # cached experts: a token's chosen experts are computed from RAM; at worst every one is first read
    # from disk (a miss), which is the bound given: `nerva bench` measures the hit rate
    missed = experts["read_bytes_per_token"] if plan.expert_layers else 0
    host += missed  # the chosen experts, computed from their cache slots
    report = {"model": f"{model.name}:{model.variant}", **plan.to_dict(), **({"experts": experts} if experts else {}),
              "tiers": {"host": {"blocks": [b.name for b in plan.fixed]
                                 + [f"layer {i}" for i in plan.resident_layers],
                                 "read_bytes_per_token": host},
                        "disk": {"blocks": ["embed"] * plan.table_aside + [f"layer {i}" for i in plan.paged_layers]
                                 + ["experts not cached (at most)"] * bool(missed),
                                 "read_bytes_per_token": paged + missed}}}
    disk = (probe or {}).get("disk_read_o_direct") or {}
    paged += missed
    if not paged:
        report["decode_bound"] = no("nothing is paged: disk reads do not bound decode")
    elif not disk.get("available"):
        report["decode_bound"] = no("run with --probe for a bound" if probe is None else disk["reason"])
    else:
        bw = disk["gb_s"] * 1e9
        report["decode_bound"] = {"available": True, "read_seconds_per_token": paged / bw,
                                  "tok_s": bw / paged, "reason": f"{paged} paged bytes a token"
                                  + (" if every chosen expert missed the cache" if missed else "")
                                  + f" at {disk['gb_s']} GB/s (O_DIRECT, measured {probe['measured_at']})"}
    return report


def expert_plan(model, plan=None) -> dict | None:
    """A mixture's experts as the plan holds them (every one in RAM, in its layer's file, or a
    cache of plan.expert_slots a layer), or None for a dense model: experts a layer and a token,
    the bytes of one, and of those a token runs and does not run in each MoE layer."""
    from nerva_cli.model.layout import expert_bytes

    cfg = model.config
    if not cfg.num_experts:
        return None
    span = expert_bytes(cfg, model.meta["files"])
    cached = plan is not None and plan.expert_layers
    return {"per_layer": cfg.num_experts, "per_token": cfg.experts_per_token, "layers": len(cfg.moe_layers),
            "expert_bytes": span, "read_bytes_per_token": span * cfg.experts_per_token * len(cfg.moe_layers),
            "idle_bytes_per_layer": 0 if cached else span * (cfg.num_experts - cfg.experts_per_token),
            "where": "host cache, the rest on disk" if cached else "host",
            "cached_per_layer": plan.expert_slots if cached else cfg.num_experts}


def gpu_plan_report(model, gp, device: str, probe: dict | None) -> dict:
    """The cuda backend's plan: VRAM-resident layers, and the paged ones by where their bytes
    come from each token (pinned RAM or disk, both through the VRAM slots); the decode bound
    from the measured pinned H2D bandwidth and, for cold layers, the O_DIRECT disk bandwidth."""
    from nerva_cli.model.layout import layer_file

    files = model.meta["files"]
    size = lambda layers: sum(files[layer_file(i)]["size"] for i in layers)  # noqa: E731
    report = {"model": f"{model.name}:{model.variant}", "device": device, **gp.to_dict(),
              "tiers": {"gpu": {"blocks": [b.name for b in gp.vram.fixed]
                                + [f"layer {i}" for i in gp.vram.resident_layers],
                                "read_bytes_per_token": size(gp.vram.resident_layers)},
                        "host (pinned)": {"blocks": [b.name for b in gp.host_fixed] + [f"layer {i}" for i in gp.warm],
                                          "read_bytes_per_token": size(gp.warm)},
                        "disk": {"blocks": [f"layer {i}" for i in gp.cold], "read_bytes_per_token": size(gp.cold)}}}
    h2d, disk = (probe or {}).get("h2d_pinned") or {}, (probe or {}).get("disk_read_o_direct") or {}
    paged, cold = size(gp.vram.paged_layers), size(gp.cold)
    if not paged:
        report["decode_bound"] = no("nothing is paged: copies do not bound decode")
    elif not h2d.get("available") or (cold and not disk.get("available")):
        report["decode_bound"] = no("run with --probe for a bound" if probe is None else
                                    (h2d if not h2d.get("available") else disk)["reason"])
    else:  # copies and disk reads overlap compute but not each other's bandwidth: the slower bounds
        seconds = max(paged / (h2d["gb_s"] * 1e9), cold / (disk["gb_s"] * 1e9) if cold else 0.0)
        report["decode_bound"] = {"available": True, "read_seconds_per_token": seconds, "tok_s": 1 / seconds,
                                  "reason": f"{paged} bytes a token host->GPU at {h2d['gb_s']} GB/s pinned"
                                  + (f", {cold} of them from disk at {disk['gb_s']} GB/s" if cold else "")
                                  + f" (measured {probe['measured_at']})"}
    return report


# -- text --------------------------------------------------------------------------------------
def _caches_line(caches: dict, human_bytes) -> str:
    """'L1d 32.0 KB, L1i 32.0 KB, L2 1.0 MB, L3 32.0 MB (cpus 0-1)': a cache's sharers are named
    where it has more than one."""
    short = {"data": "d", "instruction": "i", "unified": ""}
    parts = []
    for c in caches["levels"]:
        shared = c["shared_cpus"] or ""
        several = "," in shared or "-" in shared
        parts.append(f"L{c['level']}{short.get(c['type'], c['type'])} {human_bytes(c['size_bytes'])}"
                     + (f" (cpus {shared})" if several else ""))
    return ", ".join(parts)


def describe(info: dict) -> list[tuple[str, str]]:
    """(what, value) rows for the human output; the JSON holds the same facts."""
    from nerva_cli.units import human_bytes

    def avail(d: dict) -> str:
        return ("yes" if d["available"] else "not available") + (f" ({d['reason']})" if d.get("reason") else "")

    rows = []
    if "cpu" in info:
        c, m, s = info["cpu"], info["memory"], info["storage"]
        rows += [("cpu", c["model"]),
                 ("cores", f"{c['physical_cores']} physical, {c['logical_cores']} logical "
                           f"({c['usable_logical_cores']} usable)"),
                 ("simd", ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in c["simd"].items())
                  + f" (from {c['flags_source']})"),
                 ("caches", _caches_line(c["caches"], human_bytes) if c["caches"]["available"]
                  else avail(c["caches"])),
                 ("ram", f"{human_bytes(m['total_bytes'] or 0)} total, {human_bytes(m['available_bytes'] or 0)} "
                         "available"),
                 ("numa nodes", ", ".join(f"node{n['node']}: cpus {n['cpus']}" for n in info["numa_nodes"])
                  or "not available (no /sys/devices/system/node)"),
                 ("store", f"{s['path']} on {s['source']} ({s['fs_type']}, device {s['device']}, "
                           f"disk {s['disk']}), {human_bytes(s['free_bytes'])} free"),
                 ("nvme", avail(s["nvme"])), ("o_direct", avail(s["o_direct"])),
                 ("gpus", "; ".join(f"{d['name']}, {human_bytes(d['vram_bytes'])}, sm {d['compute_capability']}"
                                    for d in info["gpus"]["devices"]) or avail(info["gpus"])),
                 ("gpudirect storage", avail(info["gpudirect_storage"])),
                 ("peer memory", avail(info["peer_memory"]))]
        p = info["probe"]
        if p is None:
            rows.append(("probe", "none cached: run `nerva topology --probe`"))
        else:
            for key in ("ram_read", "disk_read_o_direct", "h2d_pinned", "d2h_pinned"):
                r = p[key]
                rows.append((key.replace("_", " "), f"{r['gb_s']} GB/s ({r['how']}; measured {p['measured_at']})"
                             if r["available"] else avail(r)))
    if "plan" in info:
        pl = info["plan"]
        rows += [("plan", f"{pl['model']}, budget {human_bytes(pl['budget']) if pl['budget'] else 'none'}, "
                          f"uses {human_bytes(pl['used_bytes'])}"),
                 (f"fixed ({pl.get('tier', 'host')})",
                  ", ".join(f"{k} {human_bytes(v)}" for k, v in pl["fixed"].items())),
                 *([("token table", "in pinned RAM, a row read in place a token" if pl.get("tier") == "gpu"
                     else "mapped from its file, a row read a token")] if pl.get("token_table_aside") else []),
                 ("resident layers", " ".join(map(str, pl["resident_layers"])) or "none"),
                 *([("experts", f"{pl['experts']['per_layer']} in each of {pl['experts']['layers']} layers, "
                                + ("all in RAM; " if pl['experts']['cached_per_layer'] == pl['experts']['per_layer']
                                   else f"{pl['experts']['cached_per_layer']} of them cached in RAM, the others read "
                                        "from disk when chosen; ")
                                + f"{pl['experts']['per_token']} a token read "
                                f"{human_bytes(pl['experts']['read_bytes_per_token'])} "
                                f"({human_bytes(pl['experts']['expert_bytes'])} each)")] if "experts" in pl else []),
                 ("paged layers", (" ".join(map(str, pl["paged_layers"])) or "none")
                  + (f" (through {pl['slots']} slots of {human_bytes(pl['slot_bytes'])})" if pl["slots"] else "")),
                 ("bytes per token", ", ".join(f"{t} {human_bytes(v['read_bytes_per_token'])}"
                                               for t, v in pl["tiers"].items())),
                 ("decode bound", f"{pl['decode_bound']['tok_s']:.1f} tok/s "
                                  f"({pl['decode_bound']['read_seconds_per_token'] * 1000:.2f} ms a token reading; "
                                  f"{pl['decode_bound']['reason']})" if pl["decode_bound"]["available"]
                  else avail(pl["decode_bound"]))]
    return rows
