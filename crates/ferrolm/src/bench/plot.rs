//! `bench serve --plot FILE.svg`: the latency distribution as empirical CDFs (TTFT and ITL side by
//! side), written as plain SVG so that any browser shows it and no plotting crate is needed.

use std::fmt::Write as _;

use super::metrics::percentile;

const PANEL_W: f64 = 420.0;
const PANEL_H: f64 = 300.0;
const MARGIN_L: f64 = 60.0;
const MARGIN_T: f64 = 56.0;
const MARGIN_B: f64 = 50.0;
const GAP: f64 = 80.0;
/// Most points drawn per curve (quantiles of larger samples).
const MAX_POINTS: usize = 1000;

/// One panel: a named sample, in milliseconds.
pub struct Series<'a> {
    pub title: &'a str,
    pub values_ms: &'a [f64],
}

/// An SVG document with one CDF panel per series.
pub fn cdf_svg(title: &str, series: &[Series<'_>]) -> String {
    let width = MARGIN_L + series.len() as f64 * (PANEL_W + GAP);
    let height = MARGIN_T + PANEL_H + MARGIN_B;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="15">{}</text>"#,
        width / 2.0,
        escape(title)
    );
    for (i, s) in series.iter().enumerate() {
        panel(&mut svg, MARGIN_L + i as f64 * (PANEL_W + GAP), MARGIN_T, s);
    }
    svg.push_str("</svg>\n");
    svg
}

fn panel(svg: &mut String, x0: f64, y0: f64, s: &Series<'_>) {
    let mut sorted: Vec<f64> = s.values_ms.iter().copied().filter(|v| v.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    let x_max = nice_ceiling(sorted.last().copied().unwrap_or(1.0));
    let px = |v: f64| x0 + v / x_max * PANEL_W;
    let py = |p: f64| y0 + (1.0 - p) * PANEL_H;

    // Axes, grid and ticks.
    let _ =
        writeln!(svg, r##"<rect x="{x0}" y="{y0}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#444"/>"##);
    for k in 0..=4 {
        let p = k as f64 / 4.0;
        let y = py(p);
        let _ = writeln!(svg, r##"<line x1="{x0}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/>"##, x0 + PANEL_W);
        let _ = writeln!(svg, r#"<text x="{}" y="{}" text-anchor="end">{p:.2}</text>"#, x0 - 6.0, y + 4.0);
        let v = x_max * p;
        let x = px(v);
        let _ = writeln!(svg, r##"<line x1="{x}" y1="{y0}" x2="{x}" y2="{}" stroke="#ddd"/>"##, y0 + PANEL_H);
        let _ = writeln!(svg, r#"<text x="{x}" y="{}" text-anchor="middle">{}</text>"#, y0 + PANEL_H + 16.0, tick(v));
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">{} (ms)</text>"#,
        x0 + PANEL_W / 2.0,
        y0 + PANEL_H + 36.0,
        escape(s.title)
    );
    let _ = writeln!(svg, r#"<text x="{x0}" y="{}">{}: n = {}</text>"#, y0 - 8.0, escape(s.title), sorted.len());
    let (ly, lx) = (y0 + PANEL_H / 2.0, x0 - 44.0);
    let _ = writeln!(
        svg,
        r#"<text x="{lx}" y="{ly}" text-anchor="middle" transform="rotate(-90 {lx} {ly})">fraction at or below</text>"#
    );
    if sorted.is_empty() {
        return;
    }

    // The empirical CDF as a step line through (at most) MAX_POINTS quantiles.
    let n = sorted.len();
    let step = n.div_ceil(MAX_POINTS).max(1);
    let mut path = format!("M{:.2},{:.2}", px(sorted[0]), py(0.0));
    let mut i = 0;
    while i < n {
        let p = (i + 1) as f64 / n as f64;
        let _ = write!(path, " H{:.2} V{:.2}", px(sorted[i]), py(p));
        i = if i + step < n {
            i + step
        } else if i + 1 < n {
            n - 1
        } else {
            n
        };
    }
    let _ = writeln!(svg, r##"<path d="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>"##);

    // Median and P99 markers.
    for (label, p, color) in [("p50", 50.0, "#2ca02c"), ("p99", 99.0, "#d62728")] {
        let v = percentile(&sorted, p);
        let x = px(v);
        let _ = writeln!(
            svg,
            r#"<line x1="{x}" y1="{y0}" x2="{x}" y2="{}" stroke="{color}" stroke-dasharray="4 3"/>"#,
            y0 + PANEL_H
        );
        let y = py(p / 100.0) + if p > 90.0 { 14.0 } else { -4.0 };
        // Near the right edge the label goes to the left of its line.
        let (lx, anchor) = if x > x0 + 0.8 * PANEL_W { (x - 4.0, "end") } else { (x + 4.0, "start") };
        let _ =
            writeln!(svg, r#"<text x="{lx}" y="{y}" fill="{color}" text-anchor="{anchor}">{label} {}</text>"#, tick(v));
    }
}

/// The smallest of 1, 2, 2.5 or 5 times a power of ten that is at least `v` (> 0).
fn nice_ceiling(v: f64) -> f64 {
    if v.is_nan() || v <= 0.0 {
        return 1.0;
    }
    let base = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * base).find(|&c| c >= v).unwrap_or(10.0 * base)
}

fn tick(v: f64) -> String {
    if v >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(3.2), 5.0);
        assert_eq!(nice_ceiling(20.0), 20.0);
        assert_eq!(nice_ceiling(0.021), 0.025);
        assert_eq!(nice_ceiling(0.0), 1.0);
    }

    #[test]
    fn svg_has_one_curve_per_series() {
        let ttft: Vec<f64> = (1..=50).map(f64::from).collect();
        let itl: Vec<f64> = (0..5000).map(|i| 10.0 + (i % 97) as f64 / 10.0).collect();
        let svg =
            cdf_svg("a <b>", &[Series { title: "TTFT", values_ms: &ttft }, Series { title: "ITL", values_ms: &itl }]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("stroke=\"#1f77b4\"").count(), 2);
        assert!(svg.contains("a &lt;b&gt;"));
        let empty = cdf_svg("none", &[Series { title: "TTFT", values_ms: &[] }]);
        assert!(empty.contains("n = 0"));
    }
}
