//! Who may read the metrics on the authenticated endpoint: the API server
//! decides, as it does for the kubelet's and the control plane's own
//! metrics. The bearer token goes to a TokenReview; the user it names then
//! needs `get` on the request's path, a non-resource URL, through a
//! SubjectAccessReview (a ClusterRole with `nonResourceURLs: ["/metrics"]`
//! grants it).
//!
//! A scraper asks every few seconds with the same token, so each token's
//! verdict is kept a short while: a revoked binding or an expired token
//! stops working within [`ALLOWED_FOR`]. An API server that does not answer
//! is not a verdict: that scrape gets 503 and the next one asks again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};

use crate::sync::Locked;

/// How long an allowed token is trusted without asking again.
pub const ALLOWED_FOR: Duration = Duration::from_secs(60);
/// How long a refused token stays refused without asking again.
const REFUSED_FOR: Duration = Duration::from_secs(10);
/// Verdicts kept at most; past it, expired ones go, then all.
const MOST_KEPT: usize = 1024;
/// How long one review may take.
const REVIEW_WAIT: Duration = Duration::from_secs(5);

/// What the API server said of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The user may read `path`.
    Allowed,
    /// No bearer token, or one the API server does not accept (401).
    Unauthenticated(String),
    /// An authenticated user without `get` on the path (403).
    Forbidden(String),
}

/// The API server could not decide (503: the scraper retries).
#[derive(Debug, thiserror::Error)]
#[error("the API server did not review the request: {0}")]
pub struct ReviewError(String);

/// Reviews requests against the API server, keeping recent verdicts.
pub struct Access {
    client: Client,
    kept: Mutex<HashMap<(String, String), Kept>>,
}

struct Kept {
    verdict: Verdict,
    until: Instant,
}

impl Access {
    pub fn new(client: Client) -> Self {
        Access {
            client,
            kept: Mutex::new(HashMap::new()),
        }
    }

    /// The verdict on a request for `path` with this `Authorization` header.
    pub async fn check(
        &self,
        authorization: Option<&str>,
        path: &str,
    ) -> Result<Verdict, ReviewError> {
        let Some(token) = authorization.and_then(bearer_token) else {
            return Ok(Verdict::Unauthenticated(
                "no bearer token: send `Authorization: Bearer <token>` with a token the API \
                 server accepts (e.g. a ServiceAccount's)"
                    .into(),
            ));
        };
        let key = (token.to_owned(), path.to_owned());
        if let Some(kept) = self.kept_verdict(&key) {
            return Ok(kept);
        }
        let verdict = self.review(token, path).await?;
        self.keep(key, verdict.clone());
        Ok(verdict)
    }

    fn kept_verdict(&self, key: &(String, String)) -> Option<Verdict> {
        let kept = self.kept.locked();
        let found = kept.get(key)?;
        (Instant::now() < found.until).then(|| found.verdict.clone())
    }

    fn keep(&self, key: (String, String), verdict: Verdict) {
        let now = Instant::now();
        let until = now
            + match verdict {
                Verdict::Allowed => ALLOWED_FOR,
                _ => REFUSED_FOR,
            };
        let mut kept = self.kept.locked();
        if kept.len() >= MOST_KEPT {
            kept.retain(|_, k| now < k.until);
            if kept.len() >= MOST_KEPT {
                kept.clear();
            }
        }
        kept.insert(key, Kept { verdict, until });
    }

    async fn review(&self, token: &str, path: &str) -> Result<Verdict, ReviewError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviewed = self.create(review).await?;
        let status = reviewed.status.unwrap_or_default();
        let user = match (status.authenticated, status.user) {
            (Some(true), Some(user)) => user,
            _ => {
                let why = status.error.unwrap_or_else(|| "not authenticated".into());
                return Ok(Verdict::Unauthenticated(format!(
                    "the API server does not accept the token: {why}"
                )));
            }
        };
        let name = user.username.clone().unwrap_or_default();
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.to_owned()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let decided = self.create(access).await?.status.unwrap_or_default();
        if decided.allowed {
            return Ok(Verdict::Allowed);
        }
        let reason = decided.reason.filter(|r| !r.is_empty());
        Ok(Verdict::Forbidden(format!(
            "user {name:?} may not get {path}{}: bind it to a ClusterRole with \
             nonResourceURLs [{path:?}] and verbs [\"get\"]",
            reason.map(|r| format!(" ({r})")).unwrap_or_default()
        )))
    }

    async fn create<K>(&self, review: K) -> Result<K, ReviewError>
    where
        K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
            + serde::Serialize
            + serde::de::DeserializeOwned
            + Clone
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        let api: Api<K> = Api::all(self.client.clone());
        match tokio::time::timeout(REVIEW_WAIT, api.create(&PostParams::default(), &review)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(ReviewError(e.to_string())),
            Err(_) => Err(ReviewError(format!("no answer within {REVIEW_WAIT:?}"))),
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header (the scheme is
/// case-insensitive).
fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bearer_header_with_a_token_carries_one() {
        assert_eq!(bearer_token("Bearer abc.def"), Some("abc.def"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic dXNlcjpwYXNz"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("Bearer"), None);
    }

    /// An API server that is not there: every review fails.
    fn nowhere() -> Access {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        Access::new(Client::try_from(config).unwrap())
    }

    #[tokio::test]
    async fn a_kept_verdict_answers_for_its_token_and_path_without_asking() {
        let access = nowhere();
        let asked = access.check(Some("Bearer t"), "/metrics").await;
        assert!(asked.is_err(), "{asked:?}");
        access.keep(("t".into(), "/metrics".into()), Verdict::Allowed);
        assert_eq!(
            access.check(Some("Bearer t"), "/metrics").await.unwrap(),
            Verdict::Allowed
        );
        // Another path, or another token: asked again.
        assert!(access.check(Some("Bearer t"), "/healthz").await.is_err());
        assert!(access.check(Some("Bearer u"), "/metrics").await.is_err());
        // No token: refused without asking.
        let refused = access.check(None, "/metrics").await.unwrap();
        assert!(
            matches!(refused, Verdict::Unauthenticated(_)),
            "{refused:?}"
        );
    }

    #[tokio::test]
    async fn kept_verdicts_stay_bounded() {
        let access = nowhere();
        for n in 0..MOST_KEPT + 5 {
            access.keep((format!("t{n}"), "/metrics".into()), Verdict::Allowed);
        }
        assert!(access.kept.locked().len() <= MOST_KEPT);
    }
}
