// The address Gloo binds to (internal::ChooseGlooAddress): loopback only
// where every peer is on this host, the address on the route to MASTER_ADDR
// otherwise, and for a host whose name maps to 127.0.1.1 in a job spanning
// hosts (the Debian default) its one interface address or an error that
// says what to set — never a silent bind to loopback.
#include "evenstep/internal/gloo_address.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace evenstep::internal {
namespace {

using ::testing::HasSubstr;

GlooAddressInputs TwoHosts() {
  GlooAddressInputs in;
  in.host = "node-b";
  in.master_addr = "node-a";
  in.world_size = 2;
  in.local_world_size = 1;
  in.interfaces = {"veth1=10.9.0.2"};
  return in;
}

TEST(GlooAddressTest, TheInterfaceNamedByGlooSocketIfnameWins) {
  GlooAddressInputs in = TwoHosts();
  in.ifname = "eth7";
  in.route_address = "10.9.0.2";
  EXPECT_EQ(*ChooseGlooAddress(in), "if:eth7");
}

TEST(GlooAddressTest, ALoopbackInterfaceIsRefusedAcrossHostsOnly) {
  GlooAddressInputs in = TwoHosts();
  in.ifname = "lo";
  in.ifname_loopback = true;
  absl::StatusOr<std::string> chosen = ChooseGlooAddress(in);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(),
              HasSubstr("host node-b: GLOO_SOCKET_IFNAME=lo is a loopback interface but the job "
                        "spans hosts (2 ranks, 1 on this host)"));
  in.local_world_size = 2;  // every rank on this host: loopback serves
  EXPECT_EQ(*ChooseGlooAddress(in), "if:lo");
  EXPECT_TRUE(IsLoopbackInterface("lo"));
}

TEST(GlooAddressTest, OneHostOverLoopbackBindsLoopback) {
  GlooAddressInputs in;
  in.master_addr = "127.0.0.1";
  in.world_size = in.local_world_size = 4;
  in.route_address = "127.0.0.1";
  EXPECT_EQ(*ChooseGlooAddress(in), "127.0.0.1");
  in.world_size = in.local_world_size = 1;
  in.route_address.clear();
  EXPECT_EQ(*ChooseGlooAddress(in), "127.0.0.1");
  // A host name that /etc/hosts maps to 127.0.1.1, every rank here: loopback serves.
  in.master_addr = "node-a";
  in.world_size = in.local_world_size = 2;
  in.route_address = "127.0.0.1";
  EXPECT_EQ(*ChooseGlooAddress(in), "127.0.0.1");
}

TEST(GlooAddressTest, AcrossHostsTheAddressOnTheRouteToTheMaster) {
  GlooAddressInputs in = TwoHosts();
  in.route_address = "10.9.0.2";
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
  // The master's own host: the route to its own address leaves from it.
  in.master_addr = "10.9.0.1";
  in.route_address = "10.9.0.1";
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.1");
}

TEST(GlooAddressTest, AMasterNameOnLoopbackInAJobAcrossHostsTakesTheOneInterface) {
  GlooAddressInputs in = TwoHosts();
  in.host = "node-a";
  in.route_address = "127.0.0.1";  // node-a -> 127.0.1.1 in this host's /etc/hosts
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
  in.interfaces = {"eth0=10.9.0.2", "eth0=2001:db8::2"};  // IPv4 first
  EXPECT_EQ(*ChooseGlooAddress(in), "10.9.0.2");
}

TEST(GlooAddressTest, AMasterNameOnLoopbackWithSeveralOrNoInterfacesSaysWhatToSet) {
  GlooAddressInputs in = TwoHosts();
  in.host = "node-a";
  in.route_address = "127.0.0.1";
  in.interfaces = {"eth0=10.9.0.2", "eth1=192.168.5.2"};
  absl::StatusOr<std::string> chosen = ChooseGlooAddress(in);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(),
              HasSubstr("host node-a: MASTER_ADDR=node-a is loopback here (127.0.0.1) but the "
                        "job spans hosts (2 ranks, 1 on this host)"));
  EXPECT_THAT(chosen.status().message(), HasSubstr("GLOO_SOCKET_IFNAME"));
  EXPECT_THAT(chosen.status().message(), HasSubstr("eth0=10.9.0.2, eth1=192.168.5.2"));
  in.interfaces.clear();
  chosen = ChooseGlooAddress(in);
  ASSERT_FALSE(chosen.ok());
  EXPECT_THAT(chosen.status().message(), HasSubstr("no non-loopback interface up"));
}

TEST(GlooAddressTest, NoRouteKeepsTheDefaultDevice) {
  GlooAddressInputs in = TwoHosts();
  in.route_error = "no route";
  EXPECT_EQ(*ChooseGlooAddress(in), "");
}

TEST(GlooAddressTest, TheRouteFromThisMachine) {
  EXPECT_EQ(*LocalAddressTowards("127.0.0.1", 29500), "127.0.0.1");
  EXPECT_FALSE(LocalAddressTowards("no-such-host.invalid", 29500).ok());
  // Each of this machine's own addresses is reached from itself.
  for (const std::string& i : UpInterfaceAddresses()) {
    const std::string address = i.substr(i.find('=') + 1);
    EXPECT_EQ(*LocalAddressTowards(address, 29500), address) << i;
    EXPECT_FALSE(IsLoopbackAddress(address)) << i;
  }
}

}  // namespace
}  // namespace evenstep::internal
