//! `GET /v1/models`, `GET /health` and `GET /metrics`.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

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

/// 200 while the server runs; the engine thread is reached only through its queue, so a
/// stopped engine shows as failing requests rather than here.
pub async fn health() -> StatusCode {
    StatusCode::OK
}

pub async fn metrics(State(state): State<SharedState>) -> Response {
    let text = state.metrics.render(&state.engine);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
