"""Great Expectations pieces gangflow adds: multi-column expectations and cached Data Docs views."""
