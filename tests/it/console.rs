//! The web console as the server serves it (its behaviour in a browser is tested by
//! tests/console.sh): the page and its assets without a key, same-origin only, revalidated
//! by ETag, and the contract's 404 for anything else under /console/.

use reqwest::header;

use crate::support::{TestApp, TestDb};

#[tokio::test]
async fn the_console_is_served_from_the_binary() {
    let db = TestDb::sqlite();
    let app = TestApp::spawn(&db).await;
    // No key needed (auth is `required` here): the page signs in with the API.
    let page = app
        .http
        .get(format!("{}/", app.base))
        .send()
        .await
        .expect("the server answers");
    assert_eq!(page.status().as_u16(), 200);
    let headers = page.headers().clone();
    assert_eq!(headers[header::CONTENT_TYPE], "text/html; charset=utf-8");
    let csp = headers[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .expect("ASCII");
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{csp}");
    }
    assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    let html = page.text().await.expect("a body");
    assert!(html.contains("<script defer src=\"/console/app.js\"></script>"));

    for (file, media_type) in [
        ("app.js", "text/javascript; charset=utf-8"),
        ("app.css", "text/css; charset=utf-8"),
        ("vendor/marked.umd.js", "text/javascript; charset=utf-8"),
        ("vendor/purify.min.js", "text/javascript; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
    ] {
        let url = format!("{}/console/{file}", app.base);
        let first = app.http.get(&url).send().await.expect("the server answers");
        assert_eq!(first.status().as_u16(), 200, "{file}");
        assert_eq!(first.headers()[header::CONTENT_TYPE], media_type, "{file}");
        let etag = first.headers()[header::ETAG].clone();
        assert!(!first.bytes().await.expect("a body").is_empty(), "{file}");
        // A reload revalidates: 304 without a body.
        let again = app
            .http
            .get(&url)
            .header(header::IF_NONE_MATCH, etag)
            .send()
            .await
            .expect("the server answers");
        assert_eq!(again.status().as_u16(), 304, "{file}");
        assert!(again.bytes().await.expect("a body").is_empty());
    }

    for path in ["/console/nope.js", "/console/../Cargo.toml", "/console/"] {
        app.request(reqwest::Method::GET, path, None, None)
            .await
            .expect_error(404, "not_found");
    }
    app.request(reqwest::Method::POST, "/", None, None)
        .await
        .expect_error(405, "method_not_allowed");
    app.cleanup(db).await;
}
