"""``lynxkv stream``, ``lynxkv serve`` and ``lynxkv tier``: moving caches between tiers and over the network."""

from __future__ import annotations

import signal
import threading
import time

import typer

from typing import Optional

from lynxkv.cli.app import app
from lynxkv.cli.codec import ALLOW_HELP
from lynxkv.cli.console import err, out, print_json
from lynxkv.errors import InputError


def _progress():
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TransferSpeedColumn)

    return Progress(TextColumn("{task.description:<9}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeElapsedColumn(), console=err, transient=False)


@app.command()
def stream(
    source: str = typer.Argument(..., help="Cache to load: path or URL of the anchor file (http://HOST:PORT/NAME for lynxkv serve)."),
    output: str = typer.Option(None, "-o", "--output", help="Save the received cache here (path or URL)."),
    residual: str = typer.Option(None, "--residual", help="Read the residual from here instead of the "
                                 "location the anchor header records."),
    residual_out: str = typer.Option(None, "--residual-out", help="Where to save the residual copy (default: "
                                     "the anchor's recorded relative location, next to --output)."),
    exact: bool = typer.Option(False, "--exact", help="Also read the exact segment behind the "
                               "residual and check every page; -o copies it whenever the cache has one."),
    exact_file: str = typer.Option(None, "--exact-file", help="Read the exact segment from here instead of the "
                                   "location the anchor header records (implies --exact)."),
    exact_out: str = typer.Option(None, "--exact-out", help="Where to save the exact segment's copy (default: "
                                  "the anchor's recorded relative location, next to --output)."),
    bandwidth: str = typer.Option(None, "--bandwidth", help="Emulated link rate shared by both streams, e.g. "
                                  "1Gbps, 500Mbps, 100MB/s (the anchor has strict priority)."),
    latency: str = typer.Option(None, "--latency", help="Emulated one-way latency, e.g. 2ms."),
    allow_anchor_only: bool = typer.Option(False, "--allow-anchor-only", help="If the residual fails, finish "
                                           "with the anchor only (lossy, flagged) instead of failing."),
    inflight: int = typer.Option(4, "--inflight", min=1, max=64, help="Range requests in flight per segment."),
    allow_location: Optional[list[str]] = typer.Option(None, "--allow-location", help=ALLOW_HELP),
    force: bool = typer.Option(False, "--force", help="Replace existing files when saving with -o."),
    as_json: bool = typer.Option(False, "--json", help="Print the timeline as JSON on stdout."),
) -> None:
    """Load a cache progressively (anchor first, then residual, then with --exact the exact segment), verifying
    every page; print a timeline."""
    from lynxkv.bench.emulated_link import link_at
    from lynxkv.stream.progressive import open_progressive
    from lynxkv.stream.received import ReceivedCopy
    from lynxkv.stream.summary import transfer_report

    if exact_out is not None and output is None:
        raise InputError("--exact-out needs -o (where the copy goes)")
    want_exact = True if (exact or exact_file is not None) else (None if output else False)
    saver = ReceivedCopy(output, residual_out, force=force, exact_dest=exact_out) if output else None
    load = open_progressive(source, residual=residual, link=link_at(bandwidth, latency),
                            allow_anchor_only=allow_anchor_only, inflight=inflight, decode=False,
                            tee=saver.tee if saver else None, allow_locations=allow_location or (),
                            exact=want_exact, exact_file=exact_file)
    try:
        _watch(load, want_exact)
        failure = _failure(load, want_exact, allow_anchor_only)
        report = transfer_report(load, source=source)
        if saver is not None:
            report["written"] = saver.commit(load, anchor_only=failure is not None)
    finally:
        load.close()
        if saver is not None:
            saver.close()

    if failure is not None:
        err.print(f"[bold yellow]warning:[/] residual failed, anchor only (lossy): {failure}", highlight=False)
    if as_json:
        print_json(report)
        return
    out.print(_timeline_table(source, report, failure is None))
    if report.get("monolithic"):
        out.print(_monolithic_table(report))
    if report.get("written"):
        err.print("wrote " + ", ".join(f"{k} {v}" for k, v in report["written"].items()), highlight=False)


def _watch(load, want_exact: bool | None) -> None:
    """Progress bars of the anchor, the residual and (once it is being read) the exact segment, until the load
    has resolved every segment it reads."""
    with _progress() as bars:
        ta = bars.add_task("anchor", total=None)
        tr = bars.add_task("residual", total=None)
        te = bars.add_task("exact", total=None, visible=False)

        def update() -> None:
            a_total, r_total = load.sizes
            extra = load.timeline.extra
            bars.update(ta, completed=load.timeline.anchor_bytes, total=a_total)
            bars.update(tr, completed=load.timeline.residual_bytes, total=r_total)
            if "exact_total_bytes" in extra:  # the cache has an exact segment, and it is being read
                bars.update(te, completed=extra.get("exact_bytes", 0), total=extra["exact_total_bytes"],
                            visible=True)

        while not (load.residual.done() and (want_exact is False or load.exact.done())):
            update()
            time.sleep(0.05)
        update()


def _failure(load, want_exact: bool | None, allow_anchor_only: bool) -> BaseException | None:
    """Raise what failed the load (the anchor; the residual, unless the anchor may stand alone; the exact segment
    read); else the residual's failure the load went on without (None: the whole cache came)."""
    failure = load.residual.exception()
    if load.anchor_error is not None:
        raise load.anchor_error
    if failure is not None and not allow_anchor_only:
        raise failure
    if want_exact is not False and failure is None and load.exact.exception() is not None:
        raise load.exact.exception()
    return failure


def _timeline_table(source: str, report: dict, residual_ok: bool):
    """Each segment's ready time, bytes and rate, and the total."""
    from rich.table import Table

    from lynxkv.stream.units import format_rate, format_seconds

    t = Table(title=f"lynxkv stream {source}", title_justify="left")
    for col in ("stream", "ready", "bytes", "rate"):
        t.add_column(col, justify="right" if col != "stream" else "left")
    t.add_row("anchor", format_seconds(report["anchor_ready_s"]), f"{report['anchor_bytes']:,}",
              format_rate(report["anchor_rate"]) if report["anchor_rate"] else "-")
    t.add_row("residual", format_seconds(report["residual_ready_s"]) if residual_ok else "FAILED",
              f"{report['residual_bytes']:,}", format_rate(report["residual_rate"]) if report["residual_rate"] else "-")
    if report.get("exact_bytes") is not None:
        t.add_row("exact", format_seconds(report["exact_ready_s"]), f"{report['exact_bytes']:,}",
                  format_rate(report["exact_rate"]) if report.get("exact_rate") else "-")
    t.add_row("total", "", f"{report['anchor_bytes'] + report['residual_bytes'] + (report.get('exact_bytes') or 0):,}",
              format_rate(report["total_rate"]) if report["total_rate"] else "-")
    return t


def _monolithic_table(report: dict):
    """The same cache sent whole in each monolithic format on this link, beside lynx's anchor, full code and exact."""
    from rich.table import Table

    from lynxkv.stream.units import format_seconds

    m = Table(title="monolithic transfer of the same cache on this link", title_justify="left")
    for col in ("format", "bytes", "time"):
        m.add_column(col, justify="right" if col != "format" else "left")
    for name, row in report["monolithic"].items():
        m.add_row(name.upper(), f"{row['bytes']:,}", format_seconds(row["seconds"]))
    m.add_row("lynx anchor", f"{report['anchor_bytes']:,}", format_seconds(report["anchor_ready_s"]))
    m.add_row("lynx full", f"{report['anchor_bytes'] + report['residual_bytes']:,}",
              format_seconds(report["residual_ready_s"]))
    if report.get("exact_ready_s") is not None:
        m.add_row("lynx exact", f"{report['anchor_bytes'] + report['residual_bytes'] + report['exact_bytes']:,}",
                  format_seconds(report["exact_ready_s"]))
    return m


@app.command()
def serve(
    cache: str = typer.Argument(..., help="The cache to serve: path or URL of its anchor file."),
    port: int = typer.Option(7070, "--port", min=0, max=65535, help="TCP port (0 picks a free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    residual: str = typer.Option(None, "--residual", help="The residual to serve, when the anchor records it "
                                 "outside its own directory (absolute path or URL)."),
    exact_file: str = typer.Option(None, "--exact-file", help="The exact segment to serve, when the "
                                   "anchor records it outside its own directory (absolute path or URL)."),
    allow_location: Optional[list[str]] = typer.Option(None, "--allow-location", help=ALLOW_HELP),
    bandwidth: str = typer.Option(None, "--bandwidth", help="Pace all responses to this rate, e.g. 1Gbps: the "
                                  "anchor strictly first, clients served in turn."),
    dscp_anchor: str = typer.Option(None, "--dscp-anchor", help="DSCP class of anchor responses (EF, AF41, 46)."),
    dscp_residual: str = typer.Option(None, "--dscp-residual", help="DSCP class of residual responses (CS1)."),
    dscp_exact: str = typer.Option(None, "--dscp-exact", help="DSCP class of exact-segment responses (default: "
                                   "the residual's)."),
    max_connections: int = typer.Option(1024, "--max-connections", min=1, help="Open connections at most; "
                                        "past it the longest-idle one makes room, or the new one gets a 503."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", min=0.1, help="Seconds a client has to "
                                         "send a whole request header (from connecting, or its first byte)."),
    idle_timeout: float = typer.Option(30.0, "--idle-timeout", min=0.1, help="Seconds before an idle "
                                       "connection, or a client that stops reading, is dropped."),
    write_buffer: str = typer.Option("256KiB", "--write-buffer", help="Bytes queued per connection (and its "
                                     "kernel send buffer)."),
    max_buffered: str = typer.Option("64MiB", "--max-buffered", help="Bytes queued for all connections "
                                     "together; past it only clients that keep up get more."),
    once: bool = typer.Option(False, "--once", help="Exit after every byte of the cache has been sent once."),
    as_json: bool = typer.Option(False, "--json", help="Print the address and the resources as JSON on stdout, "
                                 "and the server's counters when it exits."),
) -> None:
    """Serve one cache over HTTP: the anchor, the residual and the exact segment (when the cache has one) as
    separate resources with range requests, in that order of priority.

    SIGTERM or Ctrl-C stops it gracefully: in-flight responses get a second to finish, then it prints its counters
    (on stdout as JSON with --json) and exits 0."""
    from rich.markup import escape

    from lynxkv.serve import CacheServer, load_served_cache, parse_dscp
    from lynxkv.stream.units import format_bytes, format_rate, parse_bandwidth, parse_size

    bw = parse_bandwidth(bandwidth)
    wbuf, maxbuf = parse_size(write_buffer), parse_size(max_buffered)
    served = load_served_cache(cache, residual, exact=exact_file, allow=allow_location or ())
    server = CacheServer(served, host=host, port=port, bandwidth=bw, dscp_anchor=parse_dscp(dscp_anchor),
                         dscp_residual=parse_dscp(dscp_residual), dscp_exact=parse_dscp(dscp_exact),
                         max_connections=max_connections,
                         header_timeout=header_timeout, idle_timeout=idle_timeout, write_buffer=wbuf,
                         max_buffered=maxbuf, log=lambda msg: err.print(msg, highlight=False))
    # A SIGTERM from here until the server's loop takes the signal over (a script may stop the server as soon as
    # it has read the address) is kept for the loop's first look, not left to the default action (killed, no
    # counters). A signal ignored at start stays ignored.
    stopping = threading.Event()
    before = signal.getsignal(signal.SIGTERM)
    if before is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    if as_json:
        print_json(server.describe())
    if served.exact_skipped:
        err.print(f"[bold yellow]warning:[/] the exact segment is not served: {escape(served.exact_skipped)}",
                  highlight=False)
    if served.relocated:
        sides = [f"its {r.name} as {r.path}" for r in (served.residual, served.exact) if r is not None]
        err.print(f"the anchor is served recording {' and '.join(sides)}", highlight=False)
    err.print(f"serving {cache} at {server.url} (rate {format_rate(bw)})", highlight=False, soft_wrap=True)
    try:
        server.serve_forever(until=(lambda: stopping.is_set() or server.sent_once()) if once else stopping.is_set,
                             stop_signals=(signal.SIGTERM, signal.SIGINT))
    except KeyboardInterrupt:
        pass
    finally:
        if before is not signal.SIG_IGN:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        server.close()
        n = server.counters()
        err.print(f"served {n['served']:,} requests; connections: peak {n['peak_connections']:,}, refused "
                  f"{n['refused']:,}, closed idle {n['evicted']:,} ({n['header_timeouts']:,} without a whole "
                  f"header in time), reset after taking nothing {n['abandoned']:,}; peak queued "
                  f"{format_bytes(n['peak_buffered'])}", highlight=False, soft_wrap=True)
        if as_json:
            print_json(n)


@app.command()
def tier(
    src: str = typer.Argument(..., help="The cache's anchor file (path or URL)."),
    dst: str = typer.Argument(None, help="New location of the anchor file (default: leave it where it is)."),
    residual_out: str = typer.Option(None, "--residual-out", help="New location of the residual (path or URL)."),
    exact_out: str = typer.Option(None, "--exact-out", help="New location of the exact segment (path "
                                  "or URL)."),
    keep: bool = typer.Option(False, "--keep", help="Copy instead of move (keep the source files)."),
    allow_location: Optional[list[str]] = typer.Option(None, "--allow-location", help=ALLOW_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print what was moved as JSON on stdout."),
) -> None:
    """Move a cache's anchor, residual and/or exact segment between tiers (local, s3://, memory://, ...), atomically.

    Each segment is read, checked page by page (CRC-32) and published only if it is intact; after the copy the
    destination is read back and checked again. When the residual or the exact segment moves, the anchor header is
    rewritten to record its new location (relative when it sits next to the anchor)."""
    from lynxkv.stream.tier import move_cache

    if dst is None and residual_out is None and exact_out is None:
        raise InputError("nothing to do: give a destination for the anchor, --residual-out and/or --exact-out")
    with _progress() as bars:
        tasks: dict[str, int] = {}

        def progress(segment: str, done: int, total: int) -> None:
            if segment not in tasks:
                tasks[segment] = bars.add_task(segment, total=total)
            bars.update(tasks[segment], completed=done, total=total)

        result = move_cache(src, dst, residual_to=residual_out, exact_to=exact_out, keep=keep, progress=progress,
                            allow_locations=allow_location or ())
    if as_json:
        print_json(result)
    else:
        for k, v in result["moved"].items():
            out.print(f"{k}: {v['from']} -> {v['to']} ({v['bytes']:,} bytes, crc32 {v['crc32']:08x})")
        out.print(f"residual location recorded in the anchor: {result['residual_location']}")
        if result["exact_location"] is not None:
            out.print(f"exact location recorded in the anchor: {result['exact_location']}")
