"""Who may call and how much: API keys, tokens, origins (CORS), rate and stream limits."""
