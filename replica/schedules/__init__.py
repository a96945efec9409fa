"""Pipeline schedules as data: pure functions of integers returning per-rank action lists, and their simulation.

Nothing in this package imports torch. ``from replica.schedules import gpipe, make_schedule,
simulate`` reads the public names; each module holds one idea (actions and their dependency
rule, the 1F1B family, zero-bubble list scheduling, replay in time, simulation, graded
micro-batches).
"""

from replica.schedules.actions import BACKWARD, FORWARD, WEIGHT, Action, Schedule
from replica.schedules.schedule import (
                                        format_grid,
                                        gpipe,
                                        interleaved_one_f_one_b,
                                        make_schedule,
                                        one_f_one_b,
                                        validate,
                                        zero_bubble_h1,
                                        zero_bubble_interleaved,
                                        zero_bubble_v,
)
from replica.schedules.simulate import StageCosts, Timeline, simulate

__all__ = ["Action", "Schedule", "FORWARD", "BACKWARD", "WEIGHT", "gpipe", "one_f_one_b", "interleaved_one_f_one_b",
           "zero_bubble_h1", "zero_bubble_v", "zero_bubble_interleaved", "make_schedule", "validate", "format_grid",
           "StageCosts", "Timeline", "simulate"]
