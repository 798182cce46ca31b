"""The pure rules: every decision of a pass (the planner and what it decides with). No API client, no kopf."""
