"""Model-card templates (Markdown with Jinja2 and YAML front matter), read by vip_hub.repo.card."""
