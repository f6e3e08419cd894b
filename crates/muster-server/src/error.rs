//! API errors (always an [`ErrorBody`] with the status of its code) and the
//! request extractors whose rejections become such errors.

use crate::store::StoreError;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use muster_api::protocol::{ErrorBody, ErrorCode};
use muster_control::ControlError;
use serde::de::DeserializeOwned;

/// The largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
    /// A deposed leader's refusal: answered with
    /// [`muster_api::protocol::NO_LONGER_LEADS_HEADER`].
    pub no_longer_leads: bool,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::from_u16(code.http_status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            body: ErrorBody {
                code,
                message: message.into(),
            },
            no_longer_leads: false,
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError::new(ErrorCode::NotFound, message)
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body)).into_response();
        if self.no_longer_leads {
            response.headers_mut().insert(
                muster_api::protocol::NO_LONGER_LEADS_HEADER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

impl From<ControlError> for ApiError {
    fn from(error: ControlError) -> Self {
        let code = match &error {
            ControlError::JobNotFound(_) | ControlError::NodeNotFound(_) => ErrorCode::NotFound,
            ControlError::Conflict(_) => ErrorCode::Conflict,
            ControlError::Invalid(_) => ErrorCode::InvalidArgument,
        };
        ApiError::new(code, error.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        ApiError::new(
            ErrorCode::Unavailable,
            format!("the change was not saved: {error}; try again"),
        )
    }
}

fn too_large() -> ApiError {
    ApiError::invalid(format!(
        "the request body is larger than {MAX_BODY_BYTES} bytes (1 MiB); send a smaller one"
    ))
    .with_status(StatusCode::PAYLOAD_TOO_LARGE)
}

/// A JSON request body (no content type required), at most
/// [`MAX_BODY_BYTES`].
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    too_large()
                } else {
                    ApiError::invalid(format!(
                        "cannot read the request body: {}",
                        rejection.body_text()
                    ))
                }
            })?;
        // Every request body is a JSON object: serde would also take a
        // struct written as an array of its fields (`[null, null]`), which
        // the API's schema does not allow.
        let first = bytes.iter().find(|byte| !byte.is_ascii_whitespace());
        if first.is_some_and(|byte| *byte != b'{') {
            return Err(ApiError::invalid(
                "invalid json body: expected a JSON object ({...})",
            ));
        }
        serde_json::from_slice(&bytes)
            .map(Body)
            .map_err(|error| ApiError::invalid(format!("invalid json body: {error}")))
    }
}

/// Query parameters.
pub struct Params<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::try_from_uri(&parts.uri)
            .map(|query| Params(query.0))
            .map_err(|rejection| {
                ApiError::invalid(format!(
                    "invalid query parameters: {}",
                    rejection.body_text()
                ))
            })
    }
}

/// Path parameters.
pub struct PathParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for PathParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|path| PathParams(path.0))
            .map_err(|rejection| {
                ApiError::invalid(format!("invalid path: {}", rejection.body_text()))
            })
    }
}
