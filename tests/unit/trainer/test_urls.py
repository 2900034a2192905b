"""trainer.urls: the one helper that finds and hides credentials in URLs (issue 28.4)."""

from __future__ import annotations

import pytest

from trainer.urls import has_credentials, redact_url


@pytest.mark.parametrize("text, shown", [
    ("s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/dvc", "s3://AKIAEXAMPLE:***@bucket/dvc"),
    ("https://bob:s3cr3t-pw@mlflow.example.com/x", "https://bob:***@mlflow.example.com/x"),
    ("https://ghp_tokenonly@host/x", "https://***@host/x"),
    ("fetching from s3://k:pw1@b/dvc failed; then from gs://u:pw2@c/p", "fetching from s3://k:***@b/dvc failed; then from gs://u:***@c/p"),
    ("runtime dataset.remote='s3://k:pw@b/dvc': must not", "runtime dataset.remote='s3://k:***@b/dvc': must not"),
    ("--set data.remote=s3://k:pw@b/dvc", "--set data.remote=s3://k:***@b/dvc"),
    ("s3://bucket/dvc and http://host:5000/x?a=b", "s3://bucket/dvc and http://host:5000/x?a=b"),
])
def test_redact_hides_every_password_in_a_text_and_nothing_else(text, shown):
    assert redact_url(text) == shown


@pytest.mark.parametrize("url, has", [("s3://k:pw@b/dvc", True), ("https://tok@h/x", True), ("s3://b/dvc", False),
                                      ("file:///abs/dvc-remote", False), ("/local/path", False),
                                      ("http://h:5000/p@rt", False)])
def test_has_credentials_sees_user_info_only(url, has):
    assert has_credentials(url) is has


@pytest.mark.parametrize("password", ["it's-secret", 'pa"ss', "p@ss-word", "a'b@c\"d"])
def test_redact_hides_a_password_with_quotes_or_at_signs(password):
    """urllib takes user info up to the last `@` before the host's end: quotes and `@` included."""
    shown = redact_url(f"MLflow at http://user:{password}@127.0.0.1:9/ unavailable")
    assert shown == "MLflow at http://user:***@127.0.0.1:9/ unavailable"


@pytest.mark.parametrize("url", ["simplecache::s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/dvc",
                                 "filecache::https://tok@host/x", "blockcache::simplecache::ftp://u:pw@host/dvc"])
def test_has_credentials_sees_user_info_in_any_link_of_an_fsspec_chain(url):
    """fsspec uses a chained link's credentials (`url_to_fs("simplecache::ftp://u:pw@host/...")`)."""
    assert has_credentials(url)
    assert "pw@" not in redact_url(url) and "wJalrXUtnFEMI" not in redact_url(url)
