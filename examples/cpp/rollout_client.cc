// A C++ trainer's view of prorl: open RolloutStream, push a few math tasks,
// print every event as it arrives and the final rewards.
//
// Usage: rollout-client [host:port] [tasks]
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "prorl/v1/rollout_service.grpc.pb.h"

int main(int argc, char** argv) {
  const std::string server = argc > 1 ? argv[1] : "localhost:50051";
  const int tasks = argc > 2 ? std::atoi(argv[2]) : 3;

  auto channel = grpc::CreateChannel(server, grpc::InsecureChannelCredentials());
  auto stub = prorl::v1::RolloutService::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  if (const char* token = std::getenv("PRORL_TOKEN")) {
    context.AddMetadata("authorization", std::string("Bearer ") + token);
  }
  auto stream = stub->RolloutStream(&context);

  const auto stamp = std::chrono::system_clock::now().time_since_epoch().count();
  for (int i = 0; i < tasks; ++i) {
    prorl::v1::RolloutStreamRequest request;
    auto* rollout = request.mutable_rollout();
    rollout->set_job_id("cpp-" + std::to_string(stamp) + "-" + std::to_string(i));
    rollout->set_handler("math");
    auto& fields = *rollout->mutable_instance()->mutable_fields();
    fields["question"].set_string_value("What is " + std::to_string(i) + " + " + std::to_string(i + 1) + "?");
    fields["answer"].set_string_value(std::to_string(2 * i + 1));
    rollout->mutable_limits()->set_max_turns(3);
    if (!stream->Write(request)) {
      std::cerr << "the server closed the stream" << std::endl;
      return 1;
    }
  }
  stream->WritesDone();

  std::map<std::string, double> rewards;
  prorl::v1::RolloutStreamResponse response;
  while (stream->Read(&response)) {
    if (response.has_rejected()) {
      std::cerr << "rejected " << response.rejected().job_id() << ": " << response.rejected().message() << std::endl;
      return 1;
    }
    const auto& event = response.event();
    std::cout << event.job_id() << " #" << event.seq() << " ";
    switch (event.kind_case()) {
      case prorl::v1::RolloutEvent::kModelTurn:
        std::cout << "model_turn backend=" << event.model_turn().backend_id()
                  << " tokens=" << event.model_turn().token_ids_size();
        break;
      case prorl::v1::RolloutEvent::kFinished:
        rewards[event.job_id()] = event.finished().result().reward();
        std::cout << "finished status=" << prorl::v1::JobStatus_Name(event.finished().result().status())
                  << " reward=" << event.finished().result().reward();
        break;
      default:
        std::cout << "event kind " << event.kind_case();
    }
    std::cout << std::endl;
  }
  const grpc::Status status = stream->Finish();
  if (!status.ok()) {
    std::cerr << "stream failed: " << status.error_message() << std::endl;
    return 1;
  }
  if (static_cast<int>(rewards.size()) != tasks) {
    std::cerr << rewards.size() << " of " << tasks << " tasks finished" << std::endl;
    return 1;
  }
  for (const auto& [job, reward] : rewards) std::cout << "reward " << job << " " << reward << std::endl;
  return 0;
}
