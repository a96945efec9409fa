"""Running a plan: the one interpreter of action lists, in one process or across ranks, and its transports."""
