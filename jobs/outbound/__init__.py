"""What the control plane sends out: typed notices for chat, PagerDuty events, and the backoff
their senders share.
"""
