"""Cascades: the page names the first cause, never the last victim (docs/alerting.md).

In synchronous training one rank's fault takes the whole job down, and the ranks that end
first are often its victims: a rank blocked between steps leaves the others waiting inside
the next step's collective until MindSpore gives up (30 s on CPU, HCCL's 30 min on Ascend),
so a waiting rank fails first and the launcher then kills the rest; a stopped rank is not even
scraped; an exception on one rank makes msrun kill the others, which vanish.

So each rank's departures from the healthy state are recorded, with when and how
(`DEPARTURES{how}`):

| how | the rank ... | from |
|---|---|---|
| waited_for | stayed out of the step while another waits inside a later one | step times |
| stopped | is stopped (SIGSTOP, a debugger, a frozen host) | its node agent |
| unresponsive | is alive but its /metrics stopped answering | its node agent |
| failed | had its training ended by an exception | its own end timestamp |
| exited | ended its process on its own (not as asked) | its node agent |
| vanished | was last seen running and is gone, with no agent to say how | its series |
| ended | ended as asked (completed, stopped, cancelled): orders the others, never a cause | both |

`waited_for` counts once it lasted max(departure_seconds, departure_step_factor x the rank's
mean time outside the step per step: a rank slow on input each step is no departure),
`unresponsive` once it lasted max(departure_seconds, departure_step_factor x its mean step
interval). A departure is held for `cascade_window` after its facts vanished, and is void once
the rank completes a step after it; a `vanished` one also while a node agent reported the rank
within the last minute, and once its agent reported its exit at or after it (the agent's
scrapes had failed as the rank left).

The job's culprit is the rank that left first (`CULPRIT`), with the ranks the others waited
for within `departure_seconds` of it (a node's ranks hanging together on its storage). What
the page says of it is its own first terminal fact (failed, exited, vanished) when that came
before every other rank's departure or end, else how it left while it lived (waited_for,
stopped, unresponsive). Every other rank's departure or end is the cascade's consequence:
carried in the culprit's page, never paged on its own.

| the culprit | alert |
|---|---|
| exited first | MindFormersRankExited |
| failed first | MindFormersRankFailed |
| vanished first | MindFormersRankDown |
| waited for, stopped, unresponsive | MindFormersTrainingStalled, once some rank left for good |
|  | (the job's time-out), or at the stall threshold |
"""
from __future__ import annotations

from typing import Any

from ..contract import STATUS_RUNNING
from .promql import (
    ALIVE,
    ENDED,
    FAILED_CAUSES,
    JOB,
    WHO,
    alert,
    by_rank,
    ended_as_asked,
    indent,
    num,
    step_interval_record,
)
from .thresholds import RulesConfig, duration_seconds

#: A rank that left this way lives on (the page waits for a consequence or the stall threshold).
WAITING = ("waited_for", "stopped", "unresponsive")
#: A rank that left this way is gone for good.
TERMINAL = ("failed", "exited", "vanished")
HOWS = (*WAITING, *TERMINAL, "ended")

#: Recorded series (one rule group, in this order).
FAILED_EXIT = "job_name_rank:mfotel_node_rank_exit_timestamp_seconds:failed"
SCRAPED = "job_name_rank:mindformers_train_scrape_timestamp_seconds:max"
DEPARTURES_FRESH = "job_name_rank_how:mindformers_train_departure_timestamp_seconds:fresh"
DEPARTURES_HELD = "job_name_rank_how:mindformers_train_departure_timestamp_seconds:held"
DEPARTURES = "job_name_rank_how:mindformers_train_departure_timestamp_seconds:valid"
FIRST = "job_name_rank:mindformers_train_departure_timestamp_seconds:first"
CULPRIT = "job_name_rank_how:mindformers_train_culprit_timestamp_seconds:first"
#: The ranks past the stall threshold (`stalled_ranks`), the seconds since their last step:
#: recorded once for the three branches of MindFormersTrainingStalled, which read it.
STALLED = "job_name_rank:mindformers_train_last_step_age_seconds:stalled"
#: How long position facts (step timestamps, status) are read back after a rank's series
#: vanish: the waiting rank's last position when its time-out comes.
_POSITION_HOLD = "5m"


def _hows(names: tuple[str, ...]) -> str:
    return f'how=~"{"|".join(names)}"'


def _held(cfg: RulesConfig, name: str, window: str = _POSITION_HOLD, *matchers: str) -> str:
    return by_rank(f"last_over_time({cfg.m(name, *matchers)}[{window}])")


def _labelled(expr: str, how: str) -> str:
    return f'label_replace(\n{indent(expr)},\n  "how", "{how}", "", ""\n)'


def outside_record(cfg: RulesConfig) -> str:
    """The recorded mean seconds a rank spends outside the step per step (input, host work)."""
    return ("job_name_rank:mindformers_train_step_outside_seconds_per_step:"
            f"mean{cfg.step_interval_window}")


def _lasted(cfg: RulesConfig, since: str, per_step: str) -> str:
    """Ranks for which `time() - since` exceeds max(departure_seconds, departure_step_factor x
    the recorded `per_step` seconds)."""
    elapsed = f"(time() - {since})"
    return (f"(\n  {elapsed} > {cfg.departure_seconds}\n  unless on (job_name, rank)\n"
            f"  {elapsed} <= on (job_name, rank) {num(cfg.departure_step_factor)} * "
            f"{per_step}\n)")


def failed_exit(cfg: RulesConfig) -> str:
    """When each rank whose process ended on its own (node agent) ended."""
    m = cfg.m
    return (f"max by (job_name, rank) (\n"
            f"  {m('mfotel_node_rank_exit_timestamp_seconds')}\n"
            f"  and on (job_name, rank) {m('mfotel_node_rank_exit_info', FAILED_CAUSES)}\n"
            f")\nunless on (job_name, rank) {ended_as_asked(cfg)}")


def fresh_departures(cfg: RulesConfig) -> str:
    """The departures the facts show now, one series per rank and `how`."""
    m = cfg.m
    end = _held(cfg, "mindformers_train_last_step_timestamp_seconds")
    status = m("mindformers_train_status")
    # behind another rank in steps (out of the step after step N while another is inside step
    # N + 1: the ranks leave a step's collective together, so timestamps cannot tell) for long
    # enough, as last scraped (a missed scrape changes nothing); the time it left: its last
    # step's end
    waited_for = (f"{end}\nand on (job_name, rank)\n{indent(behind_ranks(cfg))}\n"
                  f"and on (job_name, rank) ({_held(cfg, 'mindformers_train_status')} == "
                  f"{STATUS_RUNNING})\n"
                  f"and on (job_name, rank) {_lasted(cfg, end, outside_record(cfg))}")
    answer = by_rank(m("mfotel_node_rank_endpoint_last_answer_timestamp_seconds"))
    # silent since its last answer (or its last step, if Prometheus saw a later one)
    silent_since = (f"(\n{indent(end)}\n  > on (job_name, rank)\n  {answer}\n"
                    f"  or on (job_name, rank)\n  {answer}\n)")
    up = by_rank(m("mfotel_node_rank_endpoint_up"))
    alive = by_rank(m("mfotel_node_rank_state", ALIVE))
    unresponsive = (f"{silent_since}\n"
                    f"and on (job_name, rank) ({up} == 0)\n"
                    f"and on (job_name, rank) ({alive} == 1)\n"
                    f"and on (job_name, rank) "
                    f"{_lasted(cfg, answer, step_interval_record(cfg))}")
    stopped = by_rank(m("mfotel_node_rank_stopped_timestamp_seconds"))
    window = cfg.cascade_window
    # a rank's own end, over the window: a rank lingering until scraped shows it in one scrape,
    # which an evaluation can miss (it ran before that scrape was stored, the next after the
    # rank's series went stale): the node agent's exit then paged as the cause
    end_at = "mindformers_train_end_timestamp_seconds"
    failed = _held(cfg, end_at, window, 'reason="failed"')
    last_status = _held(cfg, "mindformers_train_status", window)
    completed = _held(cfg, "mindformers_train_progress_ratio", window)
    agent_ended = _held(cfg, "mfotel_node_rank_state", window, ENDED)
    # last seen running, gone, and no node agent reports it (or its last word was an end)
    # last seen alive: its last scrape, or its last step when that ended after the scrape
    # began (the body is rendered a moment after Prometheus stamps the scrape)
    scraped = f"max by (job_name, rank) (last_over_time({SCRAPED}[{window}]))"
    seen = (f"(\n{indent(end)}\n  > on (job_name, rank)\n  {scraped}\n"
            f"  or on (job_name, rank)\n  {scraped}\n)")
    vanished = (f"{seen}\n"
                f"and on (job_name, rank) ({last_status} == {STATUS_RUNNING})\n"
                f"unless on (job_name, rank) {status}\n"
                f"unless on (job_name, rank) ({completed} >= 1)\n"
                f"unless on (job_name, rank) {m('mfotel_node_rank_state')}\n"
                f"unless on (job_name, rank) ({agent_ended} == 1)")
    exit_at = by_rank(m("mfotel_node_rank_exit_timestamp_seconds"))
    last_end = _held(cfg, end_at, window, 'reason!="failed"')
    ended = (f"{last_end}\nor on (job_name, rank)\n"
             f"({exit_at} unless on (job_name, rank) {FAILED_EXIT})")
    parts = [_labelled(waited_for, "waited_for"), _labelled(stopped, "stopped"),
             _labelled(unresponsive, "unresponsive"), _labelled(failed, "failed"),
             _labelled(FAILED_EXIT, "exited"), _labelled(vanished, "vanished"),
             _labelled(ended, "ended")]
    return "\nor\n".join(parts)


#: How long a node agent's last report of a rank voids the rank's `vanished` departure: an
#: agent's scrapes fail as its node is loaded (seven 1 s scrapes in a row in a full test run,
#: as its rank held the GIL: the departure turned valid and paged the rank as stalled); a node
#: lost with its agent and ranks pages this much later.
_AGENT_HOLD = "1m"
#: Seconds a step must end after a departure to void it: a recorded copy of a timestamp may
#: differ from the raw one in its last bits (vmalert and VictoriaMetrics: 7e-7 s at 1.8e9,
#: which voided a hung rank's own departure, its last step's end), and steps are further apart.
_VOID_MARGIN = 0.001


def _valid(departures: str, end: str) -> str:
    """`departures` but those of a rank that completed a step after them (it recovered, or a
    new run of it began)."""
    return (f"(\n{indent(departures)}\n  unless\n  (\n{indent(departures, '    ')}\n"
            f"    < on (job_name, rank) group_left ()\n{indent(end, '    ')}\n"
            f"    - {_VOID_MARGIN:g}\n  )\n)")


def _explained(cfg: RulesConfig, departures: str) -> str:
    """`departures` but a `vanished` one whose rank a node agent reported within _AGENT_HOLD,
    or whose rank's agent reported its exit at or after it: the agent's scrapes had failed as
    the rank left the healthy state (a loaded node), and the agent's facts tell how it is
    (`unresponsive`, `stopped`) or how it left (`exited`, `ended`). A rank the agent stops
    reporting without an exit (the node lost) is vanished again _AGENT_HOLD later."""
    w = cfg.cascade_window
    agent_recent = _held(cfg, "mfotel_node_rank_state", _AGENT_HOLD)
    exit_seen = _held(cfg, "mfotel_node_rank_exit_timestamp_seconds", w)
    return (f"{departures}\nunless on (job_name, rank, how)\n(\n"
            f'  label_replace(\n{indent(exit_seen, "    ")},\n    "how", "vanished", "", ""\n  )'
            f"\n  >= on (job_name, rank, how)\n"
            f'  {DEPARTURES_HELD}{{how="vanished"}} - {_VOID_MARGIN:g}\n'
            f'  or\n  label_replace({agent_recent}, "how", "vanished", "", "")\n)')


def cascade_records(cfg: RulesConfig) -> list[dict[str, Any]]:
    """The recording rules of one group, in order (each reads the ones above it)."""
    m = cfg.m
    end = _held(cfg, "mindformers_train_last_step_timestamp_seconds")
    held = _valid(f"last_over_time({DEPARTURES_HELD}[{cfg.cascade_window}])", end)
    # the rank(s) that left first; ranks the others waited for within departure_seconds of
    # that are culprits too (a node's ranks hanging together on its storage)
    culprit = (f"(\n  {FIRST}\n  == on (job_name) group_left ()\n"
               f"  min by (job_name) ({FIRST})\n  or\n"
               f"  min by (job_name, rank) ({DEPARTURES}{{{_hows(WAITING)}}})\n"
               f"  <= on (job_name) group_left ()\n"
               f"  (min by (job_name) ({FIRST}) + {cfg.departure_seconds})\n)")
    # the earliest departure or end of every rank but the culprit(s)
    others = (f"min by (job_name) (\n  min by (job_name, rank) ({DEPARTURES})\n"
              f"  unless on (job_name, rank)\n{indent(culprit)}\n)")
    own_end = (f"(\n  min by (job_name, rank) ({DEPARTURES}{{{_hows(TERMINAL)}}})\n"
               f"  and on (job_name, rank)\n{indent(culprit)}\n)")
    # the culprit's own end came first: before any other rank left or ended (or none did)
    ended_first = (f"(\n{indent(own_end)}\n  <= on (job_name) group_left ()\n{indent(others)}\n"
                   f"  or\n{indent(own_end)}\n  unless on (job_name)\n{indent(others)}\n)")
    return [
        {"record": FAILED_EXIT, "expr": failed_exit(cfg)},
        {"record": outside_record(cfg),
         "expr": f"sum by (job_name, rank) (increase("
                 f"{m('mindformers_train_step_outside_seconds_total')}[{cfg.step_interval_window}]))"
                 f"\n/\nsum by (job_name, rank) (increase("
                 f"{m('mindformers_train_steps_total')}[{cfg.step_interval_window}]))"},
        {"record": SCRAPED,
         "expr": f"max by (job_name, rank) (timestamp({m('mindformers_train_status')}))"},
        {"record": STALLED, "expr": stalled_ranks(cfg)},
        {"record": DEPARTURES_FRESH, "expr": fresh_departures(cfg)},
        # held: the facts a departure was read from vanish with the rank; the earliest of an
        # episode is kept (a rank's cancel at 330 s stays 330 when its exit at 360 s is seen),
        # and a void one (the rank stepped after it) gives way to a new episode
        {"record": DEPARTURES_HELD,
         "expr": f"(\n  {DEPARTURES_FRESH}\n  < on (job_name, rank, how)\n{indent(held)}\n)\n"
                 f"or\n{held}\nor\n{DEPARTURES_FRESH}"},
        {"record": DEPARTURES, "expr": _explained(cfg, _valid(DEPARTURES_HELD, end))},
        {"record": FIRST, "expr": f'min by (job_name, rank) ({DEPARTURES}{{how!="ended"}})'},
        {"record": CULPRIT,
         "expr": f"(\n  {DEPARTURES}{{{_hows(TERMINAL)}}}\n  == on (job_name, rank) group_left ()\n"
                 f"{indent(ended_first)}\n)\nor\n(\n"
                 f"  {DEPARTURES}{{{_hows(WAITING)}}}\n  and on (job_name, rank)\n"
                 f"{indent(culprit)}\n  unless on (job_name, rank)\n{indent(ended_first)}\n)"},
    ]


# ---------------------------------------------------------------- what the page says
#: How many of the ranks that left after the culprit its page lists, the earliest first (then
#: how many more): a time-out ends every other rank of the job, and a page listing 1,000 ranks
#: is ~100 KB that receivers truncate or refuse, with two template queries per rank at every
#: evaluation.
CONSEQUENCES_LISTED = 5
#: How each departure is told in a page (template text).
_PHRASES = {
    "waited_for": "stopped stepping",
    "stopped": "was stopped",
    "unresponsive": "stopped answering",
    "failed": "failed",
    "exited": "exited",
    "vanished": "vanished",
    "ended": "ended (cancelled, completed or stopped)",
}
#: How the culprit left while it lived, in its own page.
_CULPRIT_PHRASES = {
    "waited_for": "it stopped stepping while the others waited for it in a later step (its "
                  "data loader, host code or I/O)",
    "stopped": "its process is stopped (SIGSTOP, a debugger, a frozen host)",
    "unresponsive": "its /metrics stopped answering (a held GIL, a frozen process)",
}


def _phrase(table: dict[str, str], how: str = ".Labels.how") -> str:
    """Template text choosing `table[how]`."""
    branches = [f'{{{{ {"if" if i == 0 else "else if"} eq {how} "{key}" }}}}{text}'
                for i, (key, text) in enumerate(table.items())]
    return "".join(branches) + "{{ end }}"


def _position_of(cfg: RulesConfig, rank: str) -> str:
    """Template text: ", inside step N" or ", after step N" of the rank `rank` (a template
    expression) as it was last seen."""
    w = cfg.cascade_window

    def last(name: str) -> str:
        return f"max(last_over_time({name}{{job_name='%s',rank='%s'}}[{w}]))"
    args = f"$labels.job_name {rank}"
    inside = (f"{last('mindformers_train_step')} + 1 and on () "
              f"({last('mindformers_train_step_begin_timestamp_seconds')} > "
              f"{last('mindformers_train_last_step_timestamp_seconds')})")
    return (f'{{{{ with printf "{inside}" {args} {args} {args} | query }}}}'
            ", inside step {{ . | first | value }}{{ else }}"
            f'{{{{ with printf "{last("mindformers_train_step")}" {args} | query }}}}'
            ", after step {{ . | first | value }}{{ end }}{{ end }}")


def _culprit_text(cfg: RulesConfig) -> str:
    """Template text: the culprit's step, what followed it (the CONSEQUENCES_LISTED earliest
    other ranks, and how many more), its stacks (every culprit page)."""
    others = (f"({DEPARTURES}{{job_name='%s',rank!='%s'}} == on (rank) group_left () "
              f"min by (rank) ({DEPARTURES}{{job_name='%s',rank!='%s'}})) - on () group_left () "
              f"{FIRST}{{job_name='%s',rank='%s'}}")
    labels = ("$labels.job_name $labels.rank " * 3).strip()
    earliest = f"bottomk({CONSEQUENCES_LISTED}, {others})"
    more = f"count(count by (rank) ({others})) - {CONSEQUENCES_LISTED} > 0"
    after = (f'{{{{ with printf "{earliest}" {labels} | query | sortByLabel "rank" }}}}'
             " After it:"
             "{{ range $i, $e := . }}{{ if $i }};{{ end }} rank {{ .Labels.rank }} "
             + _phrase(_PHRASES)
             + "{{ if ge .Value 0.0 }} {{ .Value | humanizeDuration }} later"
             "{{ else }} before it{{ end }}" + _position_of(cfg, ".Labels.rank")
             + "{{ end }}"
             + f'{{{{ with printf "{more}" {labels} | query }}}}; and '
             "{{ . | first | value }} more rank(s) of the job after those{{ end }}"
             ".{{ end }}")
    return after + _stacks_text(cfg, " Its threads' stacks, captured by its node agent: ", ".")


def stacks_url(cfg: RulesConfig) -> str:
    """Template text: the URL of the rank's last stack capture on its node endpoint, or ""."""
    return _stacks_text(cfg, "", "")


def _stacks_text(cfg: RulesConfig, before: str, after: str) -> str:
    query = (f"last_over_time(mfotel_node_rank_stack_timestamp_seconds{{job_name='%s',"
             f"rank='%s'}}[{cfg.cascade_window}])")
    return (f'{{{{ with printf "{query}" $labels.job_name $labels.rank | query }}}}'
            f"{{{{ with . | first }}}}{before}{{{{ .Labels.scheme }}}}://{{{{ .Labels.instance }}}}"
            "/stacks?job_name={{ $labels.job_name | urlquery }}&rank={{ $labels.rank }}"
            f"{after}{{{{ end }}}}{{{{ end }}}}")


def _annotated(rule: dict[str, Any], cfg: RulesConfig) -> dict[str, Any]:
    """`rule` with the stacks link, kept firing for `culprit_keep_firing_for`."""
    rule["annotations"]["stacks_url"] = stacks_url(cfg)
    if duration_seconds(cfg.culprit_keep_firing_for) > 0:
        head: dict[str, Any] = {k: rule.pop(k) for k in ("alert", "expr", "for") if k in rule}
        rule = {**head, "keep_firing_for": cfg.culprit_keep_firing_for, **rule}
    return rule


# ---------------------------------------------------------------- the culprit's page
def stalled_ranks(cfg: RulesConfig) -> str:
    """Running ranks with no step for max(stall_seconds, stall_step_factor x their mean step
    interval) + stall_for (the `for` inside the expression: a consequence pages at once, and
    both pages are one alert), but for ranks whose steps are all done (their end work). Held
    over 5m: a missed scrape resets nothing."""
    m = cfg.m
    ts = _held(cfg, "mindformers_train_last_step_timestamp_seconds")
    running = _held(cfg, "mindformers_train_status")
    # every step done: in its end work (a final checkpoint save), not stalled
    done = _held(cfg, "mindformers_train_progress_ratio")
    steps = m("mindformers_train_steps_total")
    extra = duration_seconds(cfg.stall_for)
    since = f"(time() - {ts})"
    return (f"(\n  {since} > {num(cfg.stall_seconds + extra)}\n"
            f"  unless on (job_name, rank)\n"
            f"  {since} <= on (job_name, rank) {num(cfg.stall_step_factor)} * "
            f"{step_interval_record(cfg)} + {num(extra)}\n)\n"
            f"and on (job_name, rank) ({running} == {STATUS_RUNNING})\n"
            f"and on (job_name, rank) "
            f"(max by (job_name, rank) (changes({steps}[{cfg.stall_seconds}s])) == 0)\n"
            f"unless on (job_name, rank) ({done} >= 1)")


def behind_ranks(cfg: RulesConfig) -> str:
    """Ranks behind another rank of their job in steps, as last scraped: a rank's place is its
    last completed step, + 0.5 inside the next one (without the step begin timestamp, an older
    exporter, between steps). The others' places count however they ended (a waiting rank that
    timed out inside step N + 1 was ahead). A rank is behind only as scraped after the job's
    latest step end: a place read before the others stepped on is old news (a waiting rank
    not scraped while it waited, and the rank it waited for resumed)."""
    step = _held(cfg, "mindformers_train_step")
    begin = _held(cfg, "mindformers_train_step_begin_timestamp_seconds")
    end = _held(cfg, "mindformers_train_last_step_timestamp_seconds")
    scraped = by_rank(f"last_over_time({SCRAPED}[{_POSITION_HOLD}])")
    position = (f"{step}\n+ on (job_name, rank)\n"
                f"(\n  0.5 * ({begin} > bool on (job_name, rank) {end})\n"
                f"  or on (job_name, rank)\n  0 * {step}\n)")
    return (f"(\n{indent(position)}\n)\n< on (job_name) group_left ()\n"
            f"max by (job_name) (\n{indent(position)}\n)\n"
            f"and on (job_name, rank)\n"
            f"({scraped} >= on (job_name) group_left () max by (job_name) ({end}))")


def cascade_alerts(cfg: RulesConfig) -> list[dict[str, Any]]:
    """The culprit's page, one alert for each way it left (see the module docstring)."""
    m = cfg.m
    status = m("mindformers_train_status")
    lookback = cfg.rank_down_lookback
    culprit = f"max by (job_name, rank) ({CULPRIT}{{how=\"%s\"}})"
    # a rank of the job left for good: the waiting ranks' time-out, the launcher's kill
    consequence = f"max by (job_name) ({DEPARTURES}{{{_hows(TERMINAL)}}})"
    waiting = f"min by (job_name, rank) ({CULPRIT}{{{_hows(WAITING)}}})"
    stepped = m("mindformers_train_last_step_timestamp_seconds")
    behind = (f"{behind_ranks(cfg)}\nand on (job_name, rank) "
              f"({_held(cfg, 'mindformers_train_status')} == {STATUS_RUNNING})")
    context = _culprit_text(cfg)
    exit_info = m("mfotel_node_rank_exit_info", FAILED_CAUSES)
    how = ('{{ if eq $labels.cause "signal" }}killed by signal {{ $labels.signal }} '
           '({{ $labels.signal_name }})'
           '{{ else if eq $labels.cause "oom" }}killed by the kernel\'s OOM killer (signal '
           '{{ $labels.signal }}, {{ $labels.signal_name }}: its memory cgroup counted an '
           'oom_kill as it died)'
           '{{ else if eq $labels.cause "exit_code" }}exit code {{ $labels.exit_code }}'
           '{{ else }}how is unknown (its parent reaped it before the node agent read its '
           'status){{ end }}')
    step = _position_of(cfg, "$labels.rank")
    left = ("{{ range printf \"" + DEPARTURES + "{job_name='%s',rank='%s',"
            + _hows(WAITING).replace('"', "'") + "}\" $labels.job_name $labels.rank | query "
            "| sortByLabel \"how\" }}"
            "; " + _phrase(_CULPRIT_PHRASES) + "{{ end }}")
    return [
        _annotated(alert(
            cfg, "MindFormersTrainingStalled",
            # the rank the job waits for, once a rank left for good or at the stall threshold
            f"(time() - {waiting})\nand on (job_name)\n(\n"
            f"  max by (job_name) (\n{indent(STALLED, '    ')}\n  )\n  or\n  {consequence}\n)\n"
            # no rank left: the rank(s) behind the others in steps, else the job
            f"or on (job_name)\n(\n  max by (job_name, rank) (\n{indent(STALLED, '    ')}\n"
            f"    and on (job_name, rank)\n{indent(behind, '    ')}\n  )\n"
            f"  unless on (job_name) {FIRST}\n)\n"
            # no rank behind: the job, unless a rank of it stepped within the threshold (its
            # others' places were read before they stepped on)
            f"or on (job_name)\n(\n  max by (job_name) (\n{indent(STALLED, '    ')}\n  )\n"
            f"  unless on (job_name) {FIRST}\n  unless on (job_name) "
            f"(time() - max by (job_name) ({stepped}) < {cfg.stall_seconds})\n)",
            "0m", "critical", "Training made no step progress.",
            "{{ if $labels.rank }}"
            f"{WHO} is the rank the job waits for: it left the healthy state first, "
            "{{ $value | humanizeDuration }} ago" + step + left + "."
            + context +
            "{{ else }}"
            f"Every running rank of {JOB} completed no step for "
            "{{ $value | humanizeDuration }}, all stopped at the same place, no rank behind the "
            "others or gone: a hang inside the step (a collective, the device) or the same "
            "hang on every rank."
            "{{ end }}"
            f" (stall threshold: the larger of {cfg.stall_seconds}s and "
            f"{num(cfg.stall_step_factor)} x the rank's mean step interval, for "
            f"{cfg.stall_for}; a rank that left for good pages at once)"), cfg),
        _annotated(alert(
            cfg, "MindFormersRankFailed", culprit % "failed",
            "0m", "critical", "A training rank failed first and takes the job down.",
            f"{WHO} failed: an exception ended its training" + step + ", before any other "
            "rank of the job left. The others wait for it inside the next step until their "
            "collective times out, or its launcher ends them: they are its consequences, not "
            "more causes. Its traceback is in its log." + context), cfg),
        # where a node agent follows the rank (mfotel-instrument): how its process ended
        _annotated(alert(
            cfg, "MindFormersRankExited",
            f"max by (job_name, rank, cause, exit_code, signal, signal_name) ({exit_info})\n"
            f"and on (job_name, rank) {culprit % 'exited'}",
            "0m", "critical", "A training rank's process ended while the job should run.",
            f"{WHO} exited: {how}" + step + ". Its node agent saw it end before any other "
            "rank of the job left." + context), cfg),
        # without an agent: only a rank last seen running pages (completed 2, failed 3,
        # cancelled 4 and compiling 0 do not); an agent's report mutes it, and after it
        # lingered out if its last word was that the rank ended
        _annotated(alert(
            cfg, "MindFormersRankDown",
            f"(last_over_time({status}[{lookback}]) == {STATUS_RUNNING})\n"
            f"unless on (job_name, rank) {status}\n"
            f"and on (job_name, rank) {culprit % 'vanished'}",
            cfg.rank_down_for, "critical", "A training rank disappeared while running.",
            f"{WHO} (target {{{{ $labels.instance }}}}) was last seen running" + step
            + ", and has not been scraped since, before any other rank of the job left: the "
            "process died, hangs in a way that blocks /metrics, or its node is unreachable."
            + context), cfg),
    ]
