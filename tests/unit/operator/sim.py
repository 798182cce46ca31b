"""A tiny fake of the outside world for the planner's table tests: pods appear Running/Ready as soon as they are
made, and vanish at once when deleted. Test code only (it was in recreate.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from pdpair.operator.decide import recreate as d
from pdpair.operator.model.pair_spec import spec_fingerprint
from pdpair.operator.model.observed import PodView, Observed
from pdpair.operator.decide.planner import next_step


@dataclass
class SimWorld:
    """A tiny fake of the outside world for table tests: pods appear Running/Ready as soon as they're made."""

    spec: Mapping[str, Any]
    status: dict[str, Any] = field(default_factory=dict)
    pods: dict[str, PodView] = field(default_factory=dict)
    ports_complete: bool = True
    listening: Callable[[PodView], bool] = lambda pod: True
    log: list[str] = field(default_factory=list)
    now: float = 1000.0  # epoch seconds a pass sees (a scale-down's drain clock)
    # the pair's per-instance replacement record (instances.heal), as the executor keeps it: (generation, times)
    instance_restarts: tuple[int, dict[str, tuple[float, ...]]] = (0, {})

    def observe(self, restart_reason: str | None = None) -> Observed:
        decode = next(
            (p for p in self.pods.values()
             if p.role == d.ROLE_DECODE and p.instance == 0
             and p.generation == d.current_generation(self.status, self.pods.values())),
            None,
        )
        return Observed(
            pods=tuple(self.pods.values()),
            ports_complete=self.ports_complete,
            decode_listening=bool(decode and decode.running and self.listening(decode)),
            restart_reason=restart_reason,
            now=self.now,
            instance_restarts_generation=self.instance_restarts[0],
            instance_restart_times=self.instance_restarts[1],
        )

    def apply(self, plan: d.Plan) -> None:
        self.status["pairGeneration"] = plan.pair_generation
        self.status["phase"] = plan.phase
        if plan.instance_restart_times is not None:
            self.instance_restarts = (plan.pair_generation, dict(plan.instance_restart_times))
        for name in plan.force_delete + plan.delete:
            self.log.append(f"delete {name}")
            self.pods.pop(name)  # the sim's pods vanish at once
        for name in plan.mark_draining:
            self.log.append(f"drain {name}")
            self.pods[name] = dataclasses.replace(self.pods[name], draining_since=self.now)
        if plan.create:
            name = f"p-{plan.create}-{plan.pair_generation}" + (f"-{plan.create_instance}" if plan.create_instance else "")
            self.log.append(f"create {name}")
            self.pods[name] = PodView(
                name, plan.create, plan.pair_generation, spec_fingerprint(self.spec), "Running", True, "127.0.0.1",
                scheduled=True, instance=plan.create_instance,
            )


def simulate_until_ready(world: SimWorld, max_steps: int = 50, restart_reason: str | None = None) -> list[d.Plan]:
    """Run plan→apply until Ready (or a step repeats with no effect); returns every plan."""
    plans: list[d.Plan] = []
    reason = restart_reason
    for _ in range(max_steps):
        plan = next_step(world.spec, world.status, world.observe(reason))
        reason = None  # a restart request is consumed by the plan that bumps the generation
        plans.append(plan)
        if plan.step == d.STEP_READY:
            return plans
        before = (dict(world.pods), dict(world.status))
        world.apply(plan)
        if (dict(world.pods), dict(world.status)) == before:
            return plans  # stuck: the caller asserts on the last step
    raise AssertionError(f"no Ready after {max_steps} steps: {[p.step for p in plans]}")
