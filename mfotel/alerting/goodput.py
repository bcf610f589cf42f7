"""Goodput: where a run's time went, across its attempts (docs/metrics.md, "Goodput").

Every rank exports its time account (mfotel.time_account): `mindformers_train_time_seconds_total
{phase}`, whose phases add up to the time from `mindformers_train_process_start_timestamp_seconds`
to the rank's last event. These rules turn it into the run's account, one minute at a time
(the group is evaluated every minute; `offset 1m` reads the evaluation before):

1. each rank's increase over the minute, exactly (its last scrape now minus its last scrape a
   minute ago; all of it when the process is new: another process start), averaged over the
   run's ranks (`run_id` from `mindformers_train_rank_info`; without a configured run, the job
   is the run): the most ranks read at once over the run window (a rank first scraped minutes
   late joins the mean, the others' accounts counted once: `per_rank_of_run`). A rank's last
   scrape is read over `LOOKBACK` (5m, as an instant read), past the staleness a failed scrape
   or a killed process leaves: the minute a rank was killed in counts up to its last scrape,
   and a scrape that failed is no new process. A rank restarted within the minute shows its
   new process live: its old one is read back over the minute every quarter of it (OLD), and
   counts to within that of its last scrape;
2. the steps redone: each rank's steps of the minute at or below the run's high-water mark
   (the highest step every rank had completed before the latest attempt began, 0 in the
   first: ranks a step apart, or first scraped in two minutes, redo nothing), averaged; their
   share of the minute's step time is `recomputed`, the rest `goodput`;
3. the attempts: the run's first processes, then each time a rank shows a later process start
   than its known one (a rank first scraped late is none; ranks of one attempt first scraped
   in two minutes are one); the downtime: from each restarted rank's last event before (its
   old process's last scrape, else the run's) to its new process's start;
4. the run's totals (over `goodput_run_window`), its wall clock (first process start to now
   while a rank runs, else to its last event), `unaccounted` what the categories leave of it,
   and the shares of the last hour.

Categories (`category` label): goodput, recomputed, startup, input, checkpoint, evaluation,
stall, downtime; `unaccounted` in the totals and shares of the run. Alerts:
MindFormersGoodputLow (the last hour's goodput below `goodput_floor_ratio`, naming the largest
loss) and MindFormersRestartStorm (attempts that resumed from no later a step than the attempt
before them, `restart_storm_restarts` of them within an hour).
"""
from __future__ import annotations

from typing import Any

from ..time_account import PHASES
from .promql import alert, by_rank, indent, num
from .thresholds import RulesConfig, duration_seconds

#: The rule group's evaluation interval: the `offset` of every per-minute increase.
INTERVAL = "1m"
#: How far back a rank's last scrape is read (Prometheus' instant look-back).
LOOKBACK = "5m"
#: The step at which a restarted rank's old process is read back over the minute (OLD): a
#: quarter of the interval (15s), so that the subquery has points in every interval however
#: the interval is set (at an interval shorter than a fixed step it had none, and a restart
#: counted from its rank's scrape before last).
RESOLUTION_PARTS = 4


def resolution() -> str:
    """The subquery step of OLD: INTERVAL / RESOLUTION_PARTS, as a PromQL duration."""
    ms = round(duration_seconds(INTERVAL) * 1000 / RESOLUTION_PARTS)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"
#: The window of the shares and of the alerts (Prometheus 2 ranges hold both ends: 61 minutes).
WINDOW = "1h"
CATEGORIES = ("goodput", "recomputed", *(p for p in PHASES if p != "step"), "downtime")
UNACCOUNTED = "unaccounted"

# recorded series, in the group's order (later rules read earlier ones of the same evaluation)
PHASE_INCREASE = "job_name_run_id_phase:mindformers_train_time_seconds:increase1m"
STEPS_INCREASE = "job_name_run_id:mindformers_train_steps:increase1m"
STEP_MIN = "job_name_run_id:mindformers_train_step:min"
PROCESS_START = "job_name_run_id:mindformers_train_process_start_timestamp_seconds:min"
LAST_EVENT = "job_name_run_id:mindformers_train_last_event_timestamp_seconds:avg"
KNOWN_START = "job_name_rank:mindformers_train_process_start_timestamp_seconds:latest"
ATTEMPTS = "job_name_run_id:mindformers_train_attempts:increase1m"
ATTEMPT_START = "job_name_run_id:mindformers_train_attempt_start_timestamp_seconds:min"
RESUME_STEP = "job_name_run_id:mindformers_train_resume_step:first_step"
RESTARTS_NO_PROGRESS = "job_name_run_id:mindformers_train_restarts_without_progress:increase1m"
DOWNTIME = "job_name_run_id:mindformers_train_downtime_seconds:increase1m"
HIGH_WATER = "job_name_run_id:mindformers_train_step:max_before_attempt"
RANKS_SEEN = "job_name_run_id:mindformers_train_ranks_seen:count"
RANKS = "job_name_run_id:mindformers_train_ranks_seen:max"
STEP = "mindformers_train_step"
RECOMPUTED_STEPS = "job_name_run_id:mindformers_train_recomputed_steps:increase1m"
CATEGORY_INCREASE = "job_name_run_id_category:mindformers_train_time_seconds:increase1m"
CATEGORY_TOTAL = "job_name_run_id_category:mindformers_train_time_seconds:total"
WALL = "job_name_run_id:mindformers_train_wall_seconds:total"
RECOMPUTED_TOTAL = "job_name_run_id:mindformers_train_recomputed_steps:total"
SHARE_RUN = "job_name_run_id_category:mindformers_train_time:ratio_total"
SHARE_WINDOW = "job_name_run_id_category:mindformers_train_time:ratio1h"
JOB_GOODPUT = "job_name:mindformers_train_goodput:ratio1h"

RUN = "job_name, run_id"


def of_run(cfg: RulesConfig, expr: str) -> str:
    """`expr` (per rank) with the run_id of the rank's rank_info: the live one, else its last
    within LOOKBACK (a killed rank's last scrapes stay its run's)."""
    info = cfg.m("mindformers_train_rank_info")
    by = "max by (job_name, rank, run_id)"
    return (f"(\n{indent(expr)}\n)\n* on (job_name, rank) group_left (run_id)\n(\n"
            f"  {by} ({info})\n  or on (job_name, rank)\n  topk by (job_name, rank) "
            f"(1, {by} (last_over_time({info}[{LOOKBACK}])))\n)")


def _last(cfg: RulesConfig, name: str, *matchers: str, before: bool = False) -> str:
    """Each rank's series `name` (per phase: the time account) as last scraped: live, else
    its last scrape within LOOKBACK (a killed rank's, a failed scrape's; not where the rank has
    a live series at another address); a minute before with `before`."""
    offset = f" offset {INTERVAL}" if before else ""
    by = _by(name)
    series = cfg.m(name, *matchers)
    return (f"({series}{offset} or on ({by}) last_over_time({series}[{LOOKBACK}]{offset}))")


#: Each rank's series as the evaluation read them (`_last`), recorded: the next evaluation's
#: increase subtracts exactly what this one counted (a scrape stored after an evaluation ran
#: but stamped before it is counted by the next one, never lost between them).
SEEN = {name: f"job_name_rank:{name}:last_scrape" for name in (
    "mindformers_train_time_seconds_total", "mindformers_train_steps_total",
    "mindformers_train_process_start_timestamp_seconds")}
#: For a rank restarted this minute, its old process's last scrape within the minute: a restart
#: quicker than the minute (its new process scraped before this evaluation) hides the old
#: process's last scrapes from `_last`, whose live series is the new process's.
OLD = {name: f"job_name_rank:{name}:old_process_last_scrape" for name in (
    "mindformers_train_time_seconds_total", "mindformers_train_steps_total",
    "mindformers_train_step")}


def _seen(name: str, *matchers: str, before: bool = False) -> str:
    """The recorded last scrape of `name` (SEEN), this evaluation's or the one before's."""
    selector = SEEN[name] + (f"{{{', '.join(matchers)}}}" if matchers else "")
    return f"{selector} offset {INTERVAL}" if before else selector


def _same_process() -> str:
    """Ranks whose process is the one a minute ago (the same start), and ranks that export no
    process start (an exporter without the time account, the simulator): nothing tells a new
    process there, and every minute would otherwise be one."""
    start = "mindformers_train_process_start_timestamp_seconds"
    return (f"(\n  {_seen(start)} == {_seen(start, before=True)}\n"
            f"  or on (job_name, rank)\n  ({_seen('mindformers_train_steps_total')} "
            f"unless on (job_name, rank) {_seen(start)})\n)")


def _by(name: str) -> str:
    """The labels that tell one rank's series of `name` apart (the time account: per phase)."""
    return "job_name, rank, phase" if name == "mindformers_train_time_seconds_total" else \
        "job_name, rank"


def _increase(name: str, old_process: bool = False) -> str:
    """Each rank's exact increase of counter `name` since the evaluation before, to its last
    scrape; all of it for a new process (its counters started at 0) or one seen first, and
    with `old_process` what a restarted rank's old process added after the evaluation before
    (OLD)."""
    new = _seen(name)
    if old_process:
        by = _by(name)
        old = by_rank(f"clamp_min({OLD[name]} - on ({by}) group_left () "
                      f"{by_rank(_seen(name, before=True), by)}, 0)", by)
        new = f"{_seen(name)}\n+ on ({by}) group_left ()\n{old}\nor\n{_seen(name)}"
    return (f"({_seen(name)} - {_seen(name, before=True)})\n"
            f"and on (job_name, rank) {_same_process()}\nor\n{new}")


def _new_rank() -> str:
    """Ranks whose process is new this minute (their start as value): first seen, or of
    another start than the minute before."""
    start = _seen("mindformers_train_process_start_timestamp_seconds")
    before = _seen("mindformers_train_process_start_timestamp_seconds", before=True)
    return f"(\n  {start}\n  unless on (job_name, rank)\n  ({start} == {before})\n)"


def _old_process(cfg: RulesConfig, name: str) -> str:
    """OLD[name]: for each rank whose process start is later than its known one, the last
    value its old process showed within the minute: each resolution() of the minute, the last
    scrape in it while the start was the known one (up to that short of the last)."""
    start = "mindformers_train_process_start_timestamp_seconds"
    step = resolution()
    old = (f"last_over_time({cfg.m(name)}[{step}])\nand on (job_name, rank)\n"
           f"(last_over_time({cfg.m(start)}[{step}]) == on (job_name, rank) "
           f"group_left () {KNOWN_START})")
    return (f"last_over_time((\n{indent(old)}\n)[{INTERVAL}:{step}])\n"
            f"and on (job_name, rank)\n"
            f"({_seen(start)} > on (job_name, rank) group_left () "
            f"({KNOWN_START} offset {INTERVAL}))")


def _running(cfg: RulesConfig) -> str:
    """Runs with a rank initialising or running now."""
    status = cfg.m("mindformers_train_status")
    return f"count by ({RUN}) (\n{indent(of_run(cfg, f'{status} <= 1'))}\n)"


def goodput_records(cfg: RulesConfig) -> list[dict[str, Any]]:
    """The run account, in evaluation order (module docstring)."""
    time_account = _seen("mindformers_train_time_seconds_total")
    steps = _seen("mindformers_train_steps_total")
    # each rank's step as last scraped; 0 for a rank of the run that has completed no step yet
    # (steps but no step series): not left out of the step every rank has completed
    step = (f"(\n  {_last(cfg, STEP)}\n  or on (job_name, rank)\n"
            f"  {steps} * 0\n)")
    w = cfg.goodput_run_window
    # the run's high-water mark: the highest step every rank had completed before the latest
    # attempt began, taken in the minute it first showed and held until the next (0 in the
    # first attempt): what a rank does at or below it was done before. It is the higher of the
    # lowest rank's step in the records before the minute and the lowest rank's last step of
    # its old process (read back for a restart within the minute; a new process's own step
    # never counts: its rank's step a minute before does, the first attempt's ranks have none).
    # A rank's steps of the minute above the mark are its step less the mark; the rest of its
    # steps of the minute were redone
    old_step = (f"{OLD[STEP]}\nor on (job_name, rank)\n"
                f"({step} unless on (job_name, rank) {_new_rank()})\nor on (job_name, rank)\n"
                f"last_over_time({cfg.m(STEP)}[{LOOKBACK}] offset {INTERVAL})")
    old_step_min = f"min by ({RUN}) (\n{indent(of_run(cfg, old_step))}\n)"
    before_attempt = (f"max by ({RUN}) (\n"
                      f"  label_replace(max_over_time({STEP_MIN}[{w}] offset {INTERVAL}), "
                      f'"of", "records", "", "")\n  or\n'
                      f'  label_replace({indent(old_step_min, "  ").strip()}, '
                      f'"of", "old", "", "")\n)')
    high_water = (f"(\n{indent(before_attempt)}\n"
                  f"  and on ({RUN}) ({ATTEMPTS} > 0)\n)\nor\n"
                  f"(\n  last_over_time({HIGH_WATER}[{LOOKBACK}] offset {INTERVAL})\n"
                  f"  and on ({RUN}) {STEP_MIN}\n)\nor\n{STEP_MIN} * 0")
    above = by_rank(f"clamp_min(\n{indent(of_run(cfg, step))}\n"
                    f"  - on ({RUN}) group_left ()\n  {HIGH_WATER},\n  0\n)")
    redone = (f"clamp_min(\n{indent(of_run(cfg, _increase('mindformers_train_steps_total')))}"
              f"\n  - on (job_name, rank) group_left ()\n{indent(above)},\n  0\n)")
    step_time = f'sum without (phase) ({PHASE_INCREASE}{{phase="step"}})'
    recomputed_time = (f"(\n  {step_time}\n  * {RECOMPUTED_STEPS}\n  / ({STEPS_INCREASE} > 0)\n"
                       f"  or\n  {step_time} * 0\n)")
    # rank 0, if its first step of this process came within the minute: the step it resumed
    # after (one rank: the ranks' first steps of one attempt may fall in two minutes)
    steps0 = _seen("mindformers_train_steps_total", 'rank="0"')
    steps0_before = _seen("mindformers_train_steps_total", 'rank="0"', before=True)
    first_step = (f"({steps0} > 0)\nunless on (job_name, rank) (\n"
                  f"  ({steps0_before} > 0)\n  and on (job_name, rank) "
                  f"{_same_process()}\n)")
    resumed = (f"({_last(cfg, STEP)} - {steps})\nand on (job_name, rank)\n"
               f"{first_step}")
    # a rank's last event: its process start and its account (at its last scrape)
    account, start_name = "mindformers_train_time_seconds_total", \
        "mindformers_train_process_start_timestamp_seconds"
    start, start_before = _seen(start_name), _seen(start_name, before=True)
    last_event = f"{start}\n+\nsum without (phase) ({time_account})"
    # (a restarted rank's: its old process's last scrape in the minute, if one was after it)
    last_event_before = (f"{start_before}\n+\nsum without (phase) "
                         f"({OLD[account]} or on (job_name, rank, phase) "
                         f"{_seen(account, before=True)})")
    # ranks whose process is new this minute (their start as value): first seen, or restarted
    # (a later start than the rank's known one: a rank first scraped late is no restart)
    new_rank = _new_rank()
    restarted = f"{start}\n> on (job_name, rank) group_left ()\n({KNOWN_START} offset {INTERVAL})"
    # the rank's latest start, kept while its job had an event within the run window
    known_start = (f"max by (job_name, rank) ({start})\nor\n"
                   f"last_over_time({KNOWN_START}[{LOOKBACK}] offset {INTERVAL})\n"
                   f"and on (job_name)\nlast_over_time({LAST_EVENT}[{w}])")
    # a new attempt: a rank restarted, or the run's first processes
    first = (f"{of_run(cfg, new_rank)}\nunless on ({RUN})\n"
             f"max_over_time({PROCESS_START}[{w}] offset {INTERVAL})")
    attempt_ranks = f"{of_run(cfg, restarted)}\nor\n{first}"
    # ... counted unless the rank kept its process through the minute before while an attempt
    # showed there: it is that attempt's, first scraped a minute later (a rank new in both
    # minutes, as in a restart a minute after the first attempt showed, counts in both)
    twice = f"{duration_seconds(INTERVAL) * 2:g}s"
    kept = (f"{of_run(cfg, f'{KNOWN_START} offset {INTERVAL} == {KNOWN_START} offset {twice}')}"
            f"\nand on ({RUN}) ({ATTEMPTS} offset {INTERVAL} > 0)")
    counted = f"(\n{indent(attempt_ranks)}\n)\nunless on (job_name, rank) (\n{indent(kept)}\n)"
    # the latest attempt's earliest process start: set when it shows, lowered by its ranks
    # first seen later (the dashboards mark each attempt once, however its old ranks go stale);
    # `held` in parentheses: `and` binds looser than `<=`
    held = (f"last_over_time({ATTEMPT_START}[{LOOKBACK}] offset {INTERVAL})\n"
            f"and on ({RUN}) {PROCESS_START}")
    seen_now = f"min by ({RUN}) (\n{indent(of_run(cfg, new_rank))}\n)"
    attempt_start = (f"(\n  min by ({RUN}) (\n{indent(attempt_ranks, '    ')}\n  )\n"
                     f"  and on ({RUN}) ({ATTEMPTS} > 0)\n)\nor\n"
                     f"(\n  (\n{indent(held, '    ')}\n  )\n  <=\n{indent(seen_now)}\n)\nor\n"
                     f"{seen_now}\nand on ({RUN}) (\n{indent(held)}\n)\nor\n{held}")
    # each restarted rank's downtime: from its own last event a minute ago (its old process's
    # last scrape, within LOOKBACK), else from the run's last event
    known = (f"clamp_min(\n  ({indent(new_rank, '  ').strip()})\n"
             f"  - on (job_name, rank) group_left ()\n"
             f"  {by_rank(indent(last_event_before, '  ').strip())},\n  0\n)")
    unknown = f"({restarted})\nunless on (job_name, rank)\n({last_event_before})"
    rank_downtime = (f"{of_run(cfg, known)}\nor\nclamp_min(\n{indent(of_run(cfg, unknown))}\n"
                     f"  - on ({RUN}) group_left ()\n  last_over_time({LAST_EVENT}[{w}] offset "
                     f"{INTERVAL}),\n  0\n)")
    end = (f"(\n  {PROCESS_START} * 0 + time()\n  and on ({RUN})\n{indent(_running(cfg), '  ')}\n"
           f"  or\n  max_over_time({LAST_EVENT}[{w}])\n)")
    per_minute = [
        *({"record": record, "expr": _last(cfg, name)} for name, record in SEEN.items()),
        # before KNOWN_START is recorded: the subquery's last step may be this evaluation's
        *({"record": record, "expr": _old_process(cfg, name)} for name, record in OLD.items()),
        {"record": PHASE_INCREASE,
         "expr": f"avg by ({RUN}, phase) (\n{indent(of_run(cfg, _increase(account, True)))}"
                 "\n)"},
        {"record": STEPS_INCREASE,
         "expr": f"avg by ({RUN}) (\n"
                 f"{indent(of_run(cfg, _increase('mindformers_train_steps_total', True)))}\n)"},
        {"record": STEP_MIN, "expr": f"min by ({RUN}) (\n{indent(of_run(cfg, step))}\n)"},
        # the earliest start of the run's processes
        {"record": PROCESS_START,
         "expr": f"min by ({RUN}) (\n{indent(of_run(cfg, start))}\n)"},
        # the ranks this evaluation reads (each once: a rank in two scrape jobs is one rank),
        # and the most read at once over the run window: the run's ranks, whose mean the
        # categories are
        {"record": RANKS_SEEN, "expr": f"count by ({RUN}) (\n"
                                       f"{indent(by_rank(of_run(cfg, start), f'{RUN}, rank'))}\n)"},
        {"record": RANKS, "expr": f"max_over_time({RANKS_SEEN}[{w}])"},
        {"record": LAST_EVENT,
         "expr": f"avg by ({RUN}) (\n{indent(of_run(cfg, last_event))}\n)"},
        {"record": KNOWN_START, "expr": known_start},
        # 1 when a new attempt shows this minute (`counted`: an attempt's ranks first scraped
        # in two minutes count once; a share of the ranks seen counted a first attempt 1.5
        # times, its first rank being all the ranks seen then)
        {"record": ATTEMPTS,
         "expr": f"count by ({RUN}) (\n{indent(counted)}\n) * 0 + 1\nor\n{PROCESS_START} * 0"},
        {"record": ATTEMPT_START, "expr": attempt_start},
        {"record": RESUME_STEP, "expr": f"max by ({RUN}) (\n{indent(of_run(cfg, resumed))}\n)"},
        # an attempt that resumed from no later a step than the attempt before it
        {"record": RESTARTS_NO_PROGRESS,
         "expr": f"{RESUME_STEP}\n<= bool\nlast_over_time({RESUME_STEP}[{WINDOW}] offset "
                 f"{INTERVAL})"},
        # the mean of the ranks' downtime before their new process
        {"record": DOWNTIME,
         "expr": f"sum by ({RUN}) (\n{indent(by_rank(rank_downtime, f'{RUN}, rank'))}\n)\n"
                 f"/ {RANKS_SEEN}\n"
                 f"or\n{PROCESS_START} * 0"},
        {"record": HIGH_WATER, "expr": high_water},
        # each rank's steps of the minute at or below the mark, averaged like the steps
        {"record": RECOMPUTED_STEPS, "expr": f"avg by ({RUN}) (\n{indent(redone)}\n)"},
    ]
    def category(name: str, expr: str) -> dict[str, Any]:
        return {"record": CATEGORY_INCREASE, "expr": per_rank_of_run(name, expr),
                "labels": {"category": name}}
    categories = [
        category("goodput", f"{step_time}\n- {recomputed_time}"),
        category("recomputed", recomputed_time),
        *(category(phase, f'sum without (phase) ({PHASE_INCREASE}{{phase="{phase}"}})')
          for phase in PHASES if phase != "step"),
        category("downtime", DOWNTIME),
    ]
    window = duration_seconds(w)
    totals: list[dict[str, Any]] = [
        {"record": CATEGORY_TOTAL, "expr": f"sum_over_time({CATEGORY_INCREASE}[{w}])"},
        # first process start to now while a rank runs, else to the run's last event
        {"record": WALL,
         "expr": f"clamp_max(\n{indent(end)}\n  - min_over_time({PROCESS_START}[{w}]),\n"
                 f"  {num(window)}\n)"},
        {"record": CATEGORY_TOTAL,
         "expr": f'{WALL}\n- sum by ({RUN}) ({CATEGORY_TOTAL}{{category!="{UNACCOUNTED}"}})',
         "labels": {"category": UNACCOUNTED}},
        {"record": RECOMPUTED_TOTAL, "expr": f"sum_over_time({RECOMPUTED_STEPS}[{w}])"},
        {"record": SHARE_RUN,
         "expr": f"{CATEGORY_TOTAL}\n/ on ({RUN}) group_left ()\n({WALL} > 0)"},
        {"record": SHARE_WINDOW,
         "expr": f"sum_over_time({CATEGORY_INCREASE}[{WINDOW}])\n/ on ({RUN}) group_left ()\n"
                 f"(sum by ({RUN}) (sum_over_time({CATEGORY_INCREASE}[{WINDOW}])) > 0)"},
        {"record": JOB_GOODPUT,
         "expr": f'sum by (job_name) (sum_over_time({CATEGORY_INCREASE}{{category="goodput"}}'
                 f"[{WINDOW}]))\n/\n(sum by (job_name) (sum_over_time({CATEGORY_INCREASE}"
                 f"[{WINDOW}])) > 0)"},
    ]
    return [*per_minute, *categories, *totals]


def per_rank_of_run(category: str, mean: str) -> str:
    """A category's seconds of the minute per rank of the run, from `mean` (over the ranks this
    evaluation reads): their sum over RANKS. In a minute that RANKS grows (a rank first scraped
    a minute late), the category's total so far is divided anew by it, so the totals stay the
    ranks' sums over the run's ranks (a mean over the ranks read each minute counted the first
    ranks' accounts twice once a late rank joined: 13% of the wall clock once)."""
    scaled = f"(\n{indent(mean)}\n)\n* on ({RUN}) group_left ()\n({RANKS_SEEN} / {RANKS})"
    before = f'{CATEGORY_TOTAL}{{category="{category}"}} offset {INTERVAL}'
    grown = f"({RANKS} offset {INTERVAL} - {RANKS}) / {RANKS}"
    return (f"{scaled}\n+ on ({RUN})\n(\n  {before}\n  * on ({RUN}) group_left ()\n"
            f"  ({grown})\n  or on ({RUN})\n  {RANKS} * 0\n)")


RUN_OF = "{{ if $labels.run_id }}run {{ $labels.run_id }} of {{ end }}job {{ $labels.job_name }}"


def goodput_alerts(cfg: RulesConfig) -> list[dict[str, Any]]:
    window = duration_seconds(WINDOW)
    largest = ('{{ with printf "topk(1, ' + SHARE_WINDOW + "{job_name='%s', run_id='%s', "
               "category!='goodput'})\" $labels.job_name $labels.run_id | query }}"
               "{{ with . | first }}{{ .Labels.category }} "
               "({{ .Value | humanizePercentage }}){{ end }}{{ end }}")
    checkpoints = cfg.m("mindformers_train_checkpoints_total")
    return [
        alert(cfg, "MindFormersGoodputLow",
              f'max without (category) ({SHARE_WINDOW}{{category="goodput"}})\n'
              f"< {num(cfg.goodput_floor_ratio)}\n"
              f"and on ({RUN}) {_running(cfg)}\n"
              # a run younger than the window has not had an hour to account
              f"and on ({RUN}) (min_over_time({PROCESS_START}[{cfg.goodput_run_window}]) "
              f"< time() - {num(window)})",
              cfg.goodput_for, "warning", "A run's goodput over the last hour is low.",
              f"The goodput of {RUN_OF} over the last {WINDOW} is "
              "{{ $value | humanizePercentage }} (floor "
              f"{cfg.goodput_floor_ratio:.0%}): the largest loss is {largest}. "
              "See the run's time account (job_name_run_id_category:mindformers_train_time:"
              "ratio1h) for the others."),
        alert(cfg, "MindFormersRestartStorm",
              f"sum_over_time({RESTARTS_NO_PROGRESS}[{WINDOW}]) >= "
              f"{cfg.restart_storm_restarts}\n"
              # the attempt running now saved a checkpoint: progress again
              f"unless on ({RUN}) (max by ({RUN}) (\n{indent(of_run(cfg, checkpoints))}\n) > 0)",
              "0m", "warning",
              "A run keeps restarting without its checkpointed step advancing.",
              "{{ $value }} attempt(s) of " + RUN_OF + f" within the last {WINDOW} resumed "
              "from no later a step than the attempt before them (lately step "
              "{{ with printf \"last_over_time(" + RESUME_STEP + "{job_name='%s', "
              f"run_id='%s'}}[{WINDOW}])\" $labels.job_name $labels.run_id | query }}}}"
              "{{ . | first | value }}{{ end }}): each fails before its next checkpoint, and "
              "its steps since that checkpoint are computed again every time. Find why the "
              "attempts fail (the first cause's page of each), before restarting it again."),
    ]
