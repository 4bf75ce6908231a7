//! `GET /v1/models`, `GET /health` and `GET /metrics`.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use ferrolm_engine::EngineError;

use crate::error::ApiError;
use crate::protocol::models::{ModelCard, ModelList};
use crate::state::SharedState;

pub async fn list(State(state): State<SharedState>) -> Json<ModelList> {
    let name = state.config.served_model_name.clone();
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: name.clone(),
            object: "model",
            created: state.created,
            owned_by: "ferrolm",
            root: name,
            parent: None,
            max_model_len: state.engine.max_model_len(),
        }],
    })
}

/// 200 while the engine thread runs; 503 with an error body once it has died, so that a load
/// balancer takes the server out rather than send it requests that cannot be answered.
pub async fn health(State(state): State<SharedState>) -> Response {
    if state.engine.is_running() {
        return StatusCode::OK.into_response();
    }
    let body = serde_json::json!({ "error": ApiError::Engine(EngineError::Stopped).body() });
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

pub async fn metrics(State(state): State<SharedState>) -> Response {
    let text = state.metrics.render(&state.engine);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
