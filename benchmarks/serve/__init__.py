"""The model in use: batch prediction and the HTTP model service against what a user would write."""
