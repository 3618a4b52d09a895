"""The Gradio front end: chat, live dashboard, admin."""
