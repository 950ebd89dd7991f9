"""Chat front ends over the jobs service: Slack (Bolt) and the console."""
