"""bench/report.py builds its table, plots and exit status right from synthetic results.

No benchmark runs here: the results are the JSON documents the benchmarks print (same field
names), the plots are checked through the series they draw and the PNG they write.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)
sys.modules["bench_report"] = report          # dataclasses look their module up there
_spec.loader.exec_module(report)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

DOCS = {
    "store": {"append": {"records": 2_000_000, "encoded_bytes": 3e8,
                         "no_fsync": {"ours_rps": 3.45e6, "raw_rps": 5e6, "ratio_vs_raw": 0.69},
                         "fsync": {"ours_rps": 1.9e6, "raw_rps": 2.5e6, "ratio_vs_raw": 0.76}},
              "lookup": {"entries": 10_000_000, "ours_p50_us": 2.1, "ours_p99_us": 4.8,
                         "bisect_p50_us": 3.3, "bisect_p99_us": 9.6}},
    "compaction": {"records": 10_000_000, "keys": 1_000_000, "copy_s": 3.4, "compact_s": 1.7,
                   "ratio_vs_copy": 0.5, "records_per_s": 5.88e6, "peak_rss_mib": 332.0,
                   "baseline_rss_mib": 144.0, "map_mib": 128.0},
    "mirror": {"records": 2_000_000, "partitions": 8, "raw_consume_rec_per_s": 7.5e5,
               "mirror_rec_per_s": 4.5e5, "ratio": 0.6, "target_ratio": 0.8},
    "spark": {"records": 2_000_000, "partitions": 8, "mirror_local_rec_per_s": 4e5,
              "mirror_spark_rec_per_s": 4.6e5, "mirror_ratio_local_over_spark": 1.15,
              "datasource_count_all_s": 2.0, "dump_s": 3.0,
              "read_ratio_dump_over_datasource": 1.5},
    "replication": {"records": 9_000_000, "bytes": 1.38e9, "partitions": 4, "cp_s": 0.62,
                    "rebuild_s": 6.3, "ratio_rebuild_vs_cp": 10.16, "verify_equal": True},
    "kv": {"keys": 1_000_000, "updates": 10_000_000, "ours_s": 4.5,
           "quix_latest": {"ready_wall_s": 52.65}, "ratio_quix_latest": 11.7,
           "get": {"hit_p50_us": 4.3, "hit_p99_us": 8.2}},
    "s3": [{"records": 1_000_000, "partitions": p, "segments_in": 200, "segments_out": 200,
            "total": 800 + 4 * p + 1, "overhead_per_partition": 4.01, "seconds": 3.0 * p,
            "local_seconds": 1.0 * p, "time_ratio": 3.0} for p in (1, 16, 64)]
          + [{"records": 250_000, "partitions": 16, "segments_in": 200, "segments_out": 200,
              "total": 864, "overhead_per_partition": 4.0, "seconds": 30.0,
              "local_seconds": 10.0, "time_ratio": 3.0}],
    "restore": {"keys": 1_000_000, "partitions": 8, "rate_median": {"raw": 1e6, "restore": 9.5e5},
                "ratio_of_medians": 0.95, "target": 0.8},
    "kafka_peers": {"records": 1_000_000, "keys": 100_000, "partitions": 8,
                    "kafka_version": "3.9.1",
                    "mirror": {"rec_per_s": 5e5, "peer_fetch_rec_per_s": 1e6, "ratio": 0.5},
                    "restore": {"rec_per_s": 6e5, "peer_rec_per_s": 4e5, "ratio": 1.5},
                    "compaction": {"ours": {"mb_per_s": 200.0, "rec_per_s": 2e6},
                                   "kafka": {"mb_per_s": 100.0, "rec_per_s": 5e5},
                                   "ratio": 4.0}},
    "storage": {"kafka_version": "3.9.1", **{
        w: {"live": 99_997, "kafka": {"total": 2_747_754},
            "kcompact": {c: {"total": int(2_747_754 * r), "per_record": 27.5 * r, "ratio": r}}}
        for w, c, r in (("json_zstd", "zstd", 1.6), ("json_none", "uncompressed", 1.3),
                        ("random", "uncompressed", 1.1))}},
    "point_read": {"records": 1_000_000, "live": 99_997, "rounds": 3, "batch_bytes": None,
                   "baseline": "store format 1, this kcompact", "p50_us": 30.0, "p99_us": 60.0,
                   "baseline_p50_us": 25.0, "baseline_p99_us": 48.0, "p50_ratio": 1.2,
                   "p99_ratio": 1.25, "target_p99_ratio": 1.2, "met": False},
}


def ok_result(name: str, doc=None) -> "report.BenchResult":
    return report.BenchResult(name, ["python", f"bench/{name}.py", "--records", "1000"], 0, 1.5,
                              stdout=f"{name} human output line\n", stderr="progress\n",
                              doc=DOCS[name] if doc is None else doc)


def rows_of(lines: list[str], bench: str) -> list[list[str]]:
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines
            if ln.startswith(f"| {bench} |")]


def test_every_benchmark_has_a_headline_extractor():
    assert set(report.HEADLINES) == set(report.BENCHES) == set(DOCS)


def test_headline_table_puts_each_figure_next_to_its_baseline_as_a_ratio():
    results = [ok_result(n) for n in report.BENCHES]
    lines = report.headline_table(results)
    assert lines[0].startswith("| benchmark | figure | kcompact | baseline (same run) | ratio |")
    assert all(r.ok for r in results)
    (comp, rss) = rows_of(lines, "compaction")
    assert comp[2] == "1.70 s" and comp[3] == "cp -r 3.40 s"
    assert comp[4] == "0.50 (ours / cp -r)" and comp[5] == "<= 1.5" and comp[6] == "yes"
    assert rss[6] == "**no**" and "228 MiB" in rss[5]       # 332 > 128 + 100
    (mirror,) = rows_of(lines, "mirror")
    assert mirror[4] == "0.60 (ours / raw (throughput))" and mirror[6] == "**no**"
    store = rows_of(lines, "store")
    assert len(store) == 3 and store[0][6] == "**no**"      # 1.9M rec/s with fsync < 2M
    assert store[2][4].startswith("2.00 (bisect / ours)")   # 9.6 / 4.8
    (repl, verify) = rows_of(lines, "replication")
    assert repl[4].startswith("10.16") and repl[6] == "**no**" and verify[6] == "yes"
    kv = rows_of(lines, "kv")
    assert kv[0][4].startswith("11.70 (quixstreams / ours") and kv[0][6] == "yes"
    assert kv[-1][2] == "8.20 us" and kv[-1][3] == "-" and kv[-1][4] == "-"
    s3 = rows_of(lines, "s3")
    assert s3[0][2] == "4.00" and s3[0][6] == "yes"   # 2 x (in + out) / in, not the rounded 4.01
    assert s3[1][2] == "5.00 per partition"                  # (800 + 4 + 1 - 800) / 1
    assert "64 partitions" in s3[2][1] and s3[2][4].startswith("3.00 (S3 / local")
    (restore,) = rows_of(lines, "restore")
    assert restore[4].startswith("0.95") and restore[6] == "yes"
    (kmirror, krestore, kcompaction) = rows_of(lines, "kafka_peers")
    assert kmirror[3] == "Kafka's ConsumerPerformance 1.00M rec/s" and kmirror[6] == "**no**"
    assert krestore[4].startswith("1.50 (ours / Java producer") and krestore[6] == "yes"
    assert kcompaction[2] == "2.00M rec/s" and kcompaction[5] == ">= 3" and kcompaction[6] == "yes"
    assert kcompaction[3] == "Kafka's log cleaner 0.50M rec/s (100.0 MB/s)"
    assert kcompaction[4].startswith("4.00 (ours / Kafka's cleaner (records/s)")
    (jz, jn, rnd) = rows_of(lines, "storage")
    assert jz[4].startswith("1.60 (ours / Kafka (bytes))") and jz[5] == "<= 2.0" and jz[6] == "yes"
    assert jn[6] == "**no**" and rnd[6] == "yes" and "99,997 live records" in jz[1]
    (spark, read) = rows_of(lines, "spark")
    assert spark[4].startswith("1.15 (spark / local") and read[6] == "-"
    (pr,) = rows_of(lines, "point_read")
    assert pr[2] == "60.00 us" and pr[3] == "store format 1, this kcompact 48.00 us"
    assert pr[4].startswith("1.25 (ours / baseline (p99))") and pr[5] == "<= 1.2"
    assert pr[6] == "**no**"


def test_failed_and_malformed_runs_are_named_and_fail_the_report(tmp_path):
    failed = report.BenchResult("mirror", ["python", "bench/mirror.py"], 1, 3.0,
                                stdout="", stderr="Traceback ...\nRuntimeError: broker gone\n",
                                error="exit 1")
    malformed = ok_result("restore", doc={"keys": 10})
    fine = ok_result("store")
    lines = report.headline_table([fine, failed, malformed])
    assert rows_of(lines, "mirror")[0][1] == "**FAILED: exit 1** (output below)"
    assert not malformed.ok and "KeyError" in malformed.error
    assert rows_of(lines, "restore")[0][1].startswith("**FAILED: its JSON lacks")
    rep = report.Report(command="python bench/report.py --scale 0.01",
                        results=[fine, failed, malformed])
    text = rep.render()
    assert "**FAILED: mirror (exit 1); restore (its JSON lacks" in text
    assert "RuntimeError: broker gone" in text                 # the failed run's stderr, quoted
    assert "### store: ok" in text and "store human output line" in text
    assert "### mirror: FAILED (exit 1)" in text
    assert any(f.startswith("mirror") for f in rep.failures())


def test_empty_report_renders_and_fails():
    rep = report.Report(command="python bench/report.py --only store")
    text = rep.render()
    assert "## Headline figures" in text and "**Not measured**" in text
    assert "**Plot not produced**" in text
    assert rep.failures() == ["compaction throughput plot (no data)",
                              "offset map memory plot (no data)"]


def map_points(budget=1 << 20):
    held = int(budget // 16 * 0.9)
    out = []
    for f in report.MAP_FRACTIONS:
        n = max(1, round(f * held))
        out.append({"budget": budget, "keys_offered": n, "keys_held": min(n, held),
                    "max_keys": held, "full": n >= held, "table_nbytes": budget,
                    "rss_delta": budget + 4096, "rss_delta_at_alloc": budget + 4096})
    return out, held


def rounds_points(cap=14745):
    return [{"budget": 256 << 10, "capacity": cap, "keys": round(f * cap),
             "records": 2 * round(f * cap), "rounds": math.ceil(f), "records_kept": round(f * cap),
             "map_keys_max": min(cap, round(f * cap))} for f in report.ROUNDS_FRACTIONS]


def test_map_memory_plot_is_the_measurement(tmp_path):
    points, held = map_points()
    rounds = rounds_points()
    png = tmp_path / "map.png"
    series = report.plot_map_memory(points, rounds, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    xs, ys = series["table"]
    assert xs == [p["keys_offered"] for p in points]
    assert ys == pytest.approx([(1 << 20) / min(x, held) for x in xs])
    assert ys[0] > 1000 and ys[-1] == pytest.approx(17.78, abs=0.01)  # reserved, then full
    assert series["rss"][1][-1] == pytest.approx(((1 << 20) + 4096) / held)
    assert series["rounds_measured"] == ([r["keys"] / 14745 for r in rounds],
                                         [r["rounds"] for r in rounds])
    text = "\n".join(report.map_memory_section(points, rounds, "map.png", []))
    assert "![offset map memory per key](map.png)" in text
    assert f"Full, it holds {held:,} keys: 17.8 B/key" in text
    last = [ln for ln in text.splitlines() if ln.startswith(f"| {points[-1]['keys_offered']:,} |")]
    assert last and last[0].endswith("| 17.8 | 17.8 | 4 |")     # 4x capacity: 4 rounds
    assert report.rounds_needed(held + 1, held) == 2 and report.rounds_needed(held, held) == 1


def test_map_memory_plot_without_data_writes_nothing(tmp_path):
    png = tmp_path / "map.png"
    png.write_bytes(b"stale plot of an earlier run")
    assert report.plot_map_memory([], [], str(png)) is None
    assert not png.exists()
    points, _ = map_points()
    series = report.plot_map_memory(points, [], str(png))   # rounds failed: memory still plotted
    assert png.exists() and "rounds_measured" not in series
    text = "\n".join(report.map_memory_section(points, [], "map.png", ["rounds 262144: exit 1"]))
    assert "**Measurements that failed**: rounds 262144: exit 1" in text


def test_compaction_plot_and_its_failures(tmp_path):
    pts = [dict(DOCS["compaction"], records=n, copy_s=n / 3e6, compact_s=n / 6e6,
                records_per_s=6e6, ratio_vs_copy=0.5) for n in (100_000, 300_000, 1_000_000)]
    png = tmp_path / "c.png"
    errors = ["3,000,000 records: exit 1: MemoryError"]
    series = report.plot_compaction(list(reversed(pts)), errors, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert series["kcompact"] == ([100_000, 300_000, 1_000_000], [6.0, 6.0, 6.0])
    assert series["cp"][1] == pytest.approx([3.0, 3.0, 3.0])
    text = "\n".join(report.compaction_section(pts, "c.png", errors))
    assert "| 1,000,000 | 0.17 | 0.33 | 0.50 | 6,000,000 |" in text
    assert "**Runs that failed**: 3,000,000 records: exit 1: MemoryError" in text
    # every run failed, or returned a document without the figures: no plot, no crash
    assert report.plot_compaction([], list(errors), str(png)) is None and not png.exists()
    errs: list[str] = []
    assert report.plot_compaction([{"records": 5}], errs, str(png)) is None
    assert errs and "lacks" in errs[0]
    assert "**Plot not produced**" in "\n".join(report.compaction_section([], None, errs))


def test_main_writes_the_report_and_exits_1_when_a_benchmark_failed(tmp_path, monkeypatch):
    def fake_run(name, scale, timeout, tmp):
        if name == "spark":
            return report.BenchResult(name, ["python", "bench/spark.py"], 1, 2.0,
                                      stderr="Java not found\n", error="exit 1")
        return ok_result(name)

    points, _ = map_points()
    monkeypatch.setattr(report, "run_bench", fake_run)
    monkeypatch.setattr(report, "measure_map_memory", lambda budget: (points, rounds_points(), []))
    monkeypatch.setattr(report, "compaction_points",
                        lambda scale, timeout, reuse: ([reuse.doc], []))
    assert report.main(["--scale", "0.01", "--out", str(tmp_path), "--only",
                        "store,compaction,spark"]) == 1
    text = (tmp_path / "REPORT.md").read_text()
    assert "**FAILED: spark (exit 1)" in text and "Java not found" in text
    assert "At `--scale 0.01` every benchmark runs at that fraction" in text
    assert "![compaction throughput](compaction-throughput.png)" in text
    assert "![offset map memory per key](map-memory-per-key.png)" in text
    for f in ("compaction-throughput.png", "map-memory-per-key.png"):
        assert (tmp_path / f).read_bytes()[:8] == PNG_MAGIC
    monkeypatch.setattr(report, "run_bench", lambda name, *a: ok_result(name))
    assert report.main(["--out", str(tmp_path), "--only", "store,compaction"]) == 0
    assert "FAILED" not in (tmp_path / "REPORT.md").read_text()
    assert sorted(os.listdir(tmp_path)) == ["REPORT.md", "compaction-throughput.png",
                                            "map-memory-per-key.png"]


def test_json_from_stdout_skips_text_before_the_document():
    assert report._json_from_stdout('note: {x}\n{\n  "a": 1\n}\n') == {"a": 1}
    assert report._json_from_stdout('[\n {"b": 2}\n]') == [{"b": 2}]
    with pytest.raises(ValueError):
        report._json_from_stdout("no json here")
