//! Credentials for tests of a server that requires them: one service token
//! and viewer JWTs signed with a test secret.

use std::time::{SystemTime, UNIX_EPOCH};

use presence_server::{AuthConfig, ServerConfig};

use super::fast_config;

pub const SERVICE: &str = "service-token-for-tests";
pub const SECRET: &str = "a-test-only-hs256-secret-of-at-least-32-bytes";

pub fn unix_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// A viewer's JWT, signed with the test secret, valid for a minute (or expired).
pub fn viewer_token(subject: &str, expired: bool) -> String {
    let exp = if expired { unix_secs() - 3_600 } else { unix_secs() + 60 };
    let claims = serde_json::json!({ "sub": subject, "exp": exp });
    let key = jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).unwrap();
    jsonwebtoken::encode(&jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256), &claims, &key).unwrap()
}

/// The fast configuration, requiring the service token or a viewer JWT.
pub fn secured_config() -> ServerConfig {
    let mut config = fast_config();
    config.auth = AuthConfig {
        service_tokens: vec![SERVICE.into()],
        viewer_jwt_hs256_secret: Some(SECRET.into()),
        ..AuthConfig::default()
    };
    config
}
